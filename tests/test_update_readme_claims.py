"""tools/update_readme_claims.py: the README's claims block rewritten from a report's answers, the rest untouched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from grpo_lens.report.answers import ANSWER_COLUMNS
from grpo_lens.report.format import md_row, md_table

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("update_readme_claims", ROOT / "tools" / "update_readme_claims.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

README = """# title

<!-- claims-table:begin (the default model's claims; replace this block) -->
old table
<!-- claims-table:end -->

## Quickstart
"""

ROW = md_row("G1 rank ≈ 2 (probe, R = 4)", "**does not hold**", "E₂ 0.73 [0.66, 0.80]", "16", "0.02")
REPORT = "\n".join(
    [
        "# grpo-lens report",
        "",
        "## Answers",
        "",
        "One entry per primary claim.",
        "",
        *md_table(list(ANSWER_COLUMNS)),
        ROW,
        "",
        "p-values, bounds, controls and rules: the claims table in the appendix.",
        "",
        "### Rank ≈ 2: every reading side by side",
        "",
        "| reading | R = 4 |",
        "",
        "## Figures",
        "![x](x.png)",
        "## Appendix",
    ]
)


def _out(tmp_path, report: str = REPORT) -> Path:
    out = tmp_path / "decide"
    out.mkdir(parents=True)
    (out / "report.md").write_text(report)
    saved = {"preset": "configs/decide-cpu.yaml", "probe_seeds": [0, 1, 2], "train_seeds": [0, 1, 2, 3, 4]}
    (out / "demo.yaml").write_text(yaml.safe_dump(saved))
    for stage, last in (("probe", "probe.json"), ("train", "train_seeds.json")):  # each stage's last file: finished
        (out / stage).mkdir(), (out / stage / last).write_text("{}")
    return out


def test_block_is_the_reports_answers_and_nothing_else_changes(tmp_path):
    out = _out(tmp_path)
    new = tool.updated(README, out)
    head, block, tail = new.partition("<!-- claims-table:begin (the default model's claims; replace this block) -->\n")
    assert head == "# title\n\n" and tail.endswith("<!-- claims-table:end -->\n\n## Quickstart\n")
    assert tail.startswith(
        "The paper's claims on the default model: `grpo-lens demo --preset configs/decide-cpu.yaml --out runs/decide` "
        "(the probe pooled over seeds 0, 1, 2; the claims over training decided over seeds 0, 1, 2, 3, 4).\n\n"
    )
    assert ROW in tail and "old table" not in tail and "![x]" not in tail and "## Appendix" not in tail
    # headings become bold lines (the README keeps its own outline); the appendix is report.md's
    assert "**Rank ≈ 2: every reading side by side**" in tail and "### " not in tail
    assert "the claims table in report.md's appendix" in tail
    assert tool.updated(new, out) == new  # a second run changes nothing


def test_check_mode_and_refusals(tmp_path, capsys):
    out = _out(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert tool.main([str(out), "--readme", str(readme), "--check"]) == 1 and readme.read_text() == README
    assert tool.main([str(out), "--readme", str(readme)]) == 0 and ROW in readme.read_text()
    assert tool.main([str(out), "--readme", str(readme), "--check"]) == 0
    with pytest.raises(SystemExit, match="no <!-- claims-table:begin"):
        tool.updated("# no block\n", out)
    with pytest.raises(SystemExit, match="hold no claims table"):  # a report without --preset: a list, no table
        tool.updated(README, _out(tmp_path / "plain", "## Answers\n\n- **holds**: a claim"))
    with pytest.raises(SystemExit, match="report.md is missing"):
        tool.updated(README, tmp_path / "nothing")


def test_source_line_names_the_stage_not_finished(tmp_path):
    out = _out(tmp_path)
    (out / "train" / "train_seeds.json").unlink()  # training still runs: the table holds the probe's claims alone
    assert tool.source_line(out) == (
        "The paper's claims on the default model: `grpo-lens demo --preset configs/decide-cpu.yaml --out runs/decide` "
        "(the probe pooled over seeds 0, 1, 2; training (seeds 0, 1, 2, 3, 4) not finished: its claims are not in "
        "the table yet)."
    )


def test_source_line_shows_out_as_run_from_here(tmp_path, monkeypatch):
    out = _out(tmp_path)
    monkeypatch.chdir(tmp_path)  # OUT under the working directory: as given; elsewhere: runs/<its name> (above)
    assert "`grpo-lens demo --preset configs/decide-cpu.yaml --out decide` (" in tool.source_line(out)
