"""Rewrite README.md's claims block from a run's report: the lead's step after ``demo --preset`` (docs/seeds.md).

    .venv/bin/python tools/update_readme_claims.py runs/decide            # rewrite README.md's block in place
    .venv/bin/python tools/update_readme_claims.py runs/decide --check    # exit 1 if the block differs
    .venv/bin/python tools/update_readme_claims.py runs/decide --readme OTHER.md

The block sits between ``<!-- claims-table:begin ... -->`` and ``<!-- claims-table:end -->``; the begin line is kept as
it is. Its new contents are OUT/report.md's answers section as the report writes it (the claims table of every
primary claim, the checks, the rank readings and their non-zero-sum control), whatever the verdicts are: nothing is
re-derived or re-rendered here, headings become bold lines (the README's own headings stay its outline), and a first
line names the command and seeds the numbers come from (read from OUT/demo.yaml).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from grpo_lens.report.answers import ANSWER_COLUMNS
from grpo_lens.report.format import md_row

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"(<!-- claims-table:begin[^>]*-->\n)(.*?)(<!-- claims-table:end -->)", re.S)
ANSWERS = "## Answers"


def answers_of(report: str) -> list[str]:
    """The answers section of a report.md's text (from ``## Answers`` to the next ``## `` heading), without its
    heading, its headings made bold lines, blank lines at its ends dropped.

    Raises:
        SystemExit: the report has no answers section, or it holds no claims table (not a ``demo --preset`` report).
    """
    lines = report.splitlines()
    if ANSWERS not in lines:
        raise SystemExit("the report has no '## Answers' section: write it with `grpo-lens demo --preset ...`")
    start = lines.index(ANSWERS) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = [re.sub(r"^#{3,6} (.*)$", r"**\1**", line) for line in lines[start:end]]
    if md_row(*ANSWER_COLUMNS) not in body:
        raise SystemExit("the report's answers hold no claims table: write it with `grpo-lens demo --preset ...`")
    body = [line.replace("table in the appendix", "table in report.md's appendix") for line in body]
    while body and not body[0].strip():
        body.pop(0)
    while body and not body[-1].strip():
        body.pop()
    return body


def source_line(out: Path) -> str:
    """The block's first line: the command and seeds the numbers come from (OUT/demo.yaml of ``demo --preset``)."""
    try:
        saved = yaml.safe_load((out / "demo.yaml").read_text(encoding="utf8")) or {}
    except (OSError, yaml.YAMLError):
        saved = {}
    if not isinstance(saved, dict) or not saved.get("preset"):
        return f"The paper's claims on the default model, from `{out.name}/report.md`:"
    seeds = ", ".join(map(str, saved.get("probe_seeds") or []))
    train = ", ".join(map(str, saved.get("train_seeds") or []))
    # a stage is finished when its last file is written (demo.finished_stages): probe.json, train_seeds.json
    probe = f"the probe pooled over seeds {seeds}" if (out / "probe" / "probe.json").is_file() else "probe not finished"
    if (out / "train" / "train_seeds.json").is_file():
        train = f"the claims over training decided over seeds {train}"
    else:
        train = f"training (seeds {train}) not finished: its claims are not in the table yet"
    try:  # the command as a reader runs it from the repository: OUT relative to here, else runs/<OUT's name>
        shown = out.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        shown = f"runs/{out.resolve().name}"
    return (
        f"The paper's claims on the default model: `grpo-lens demo --preset {saved['preset']} --out {shown}` "
        f"({probe}; {train})."
    )


def updated(readme: str, out: Path) -> str:
    """``readme`` with its claims block's contents replaced by :func:`source_line` and :func:`answers_of` of
    OUT/report.md.

    Raises:
        SystemExit: no report.md in OUT, or the README has no claims block (its begin and end markers).
    """
    report = out / "report.md"
    if not report.is_file():
        raise SystemExit(f"{report} is missing: run `grpo-lens demo --preset ... --out {out}` first")
    block = "\n".join([source_line(out), "", *answers_of(report.read_text(encoding="utf8"))]) + "\n"
    if not BLOCK.search(readme):
        raise SystemExit("the README has no <!-- claims-table:begin ... --> ... <!-- claims-table:end --> block")
    return BLOCK.sub(lambda m: m.group(1) + block + m.group(3), readme, count=1)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the README's claims block, or with ``--check`` exit 1 when it differs from the report's."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the run directory (demo --preset's OUT) holding report.md")
    parser.add_argument("--readme", type=Path, default=README, help="the README to rewrite (default: the repo's)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the block differs; write nothing")
    args = parser.parse_args(argv)
    text = args.readme.read_text(encoding="utf8")
    new = updated(text, args.out)
    if args.check:
        if new != text:
            print(f"{args.readme}'s claims block differs from {args.out}/report.md's answers")
            return 1
        return 0
    args.readme.write_text(new, encoding="utf8")
    print(f"{args.readme}: claims block rewritten from {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
