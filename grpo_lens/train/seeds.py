"""``grpo-lens train --seeds 0 1 2 --out DIR``: one training run per seed, then one pooled record (docs/seeds.md).

Layout of DIR (as ``probe --seeds`` lays out its probes)::

    config.yaml        the settings every seed ran with (TrainConfig fields; ``seed`` is each seed dir's own)
    seed_<s>/          an ordinary training run directory per seed (metrics.jsonl, config.yaml, checkpoints), so
                       ``grpo-lens report DIR/seed_<s>`` and ``train --resume --out DIR/seed_<s>`` work on it alone
    train_seeds.json   the pooled record: {"seeds": [s, ...], "dirs": ["seed_<s>", ...], "steps": [each seed's
                       last logged step]}
    report.md          ``grpo-lens report DIR``: the first seed's training section, and the claims over training
                       decided on every seed's metrics.jsonl (each seed's OLS slope with a t over seeds; "rank stays"
                       by the t over seeds of each seed's lowest E₂: docs/theory.md §11, §12)

The pooled record keeps no numbers of its own: the report reads the seeds' metrics.jsonl, so a seed resumed or
rerun changes the pooled claims at the next ``grpo-lens report DIR``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from grpo_lens.config import ConfigError
from grpo_lens.config.base import refuse_started_seeds, seeds_run_args
from grpo_lens.config.train import TrainConfig
from grpo_lens.rundir import TRAIN_SEEDS_FILE, atomic_write_text, start_seeds_dir
from grpo_lens.train.loop import train

logger = logging.getLogger(__name__)

#: the pooled record's file in DIR (:func:`grpo_lens.rundir.read_train_seeds` reads it for the report)
SEEDS_FILE = TRAIN_SEEDS_FILE


def seed_dir(out: str | Path, seed: int) -> Path:
    """DIR/seed_<s>: one seed's training run (the name ``probe --seeds`` uses)."""
    return Path(out) / f"seed_{int(seed)}"


def _last_step(run_dir: Path) -> int | None:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    steps = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # a torn or crafted line: the run's own resume names it
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), (int, float)):
            steps.append(int(rec["step"]))
    return max(steps, default=None)


def write_seeds_record(out: str | Path, seeds: list[int]) -> Path:
    """Write DIR/train_seeds.json for ``seeds`` (each DIR/seed_<s> a training run); return its path.

    Raises:
        ConfigError: a seed's directory has no metrics.jsonl (it did not train).
    """
    out = Path(out)
    missing = [s for s in seeds if not (seed_dir(out, s) / "metrics.jsonl").is_file()]
    if missing:
        raise ConfigError(
            f"{out}: seed {missing[0]} has no {seed_dir(out, missing[0]) / 'metrics.jsonl'}; "
            f"run `grpo-lens train --seeds ... --resume --out {out}` to train it"
        )
    record = {
        "seeds": list(seeds),
        "dirs": [seed_dir(out, s).name for s in seeds],
        "steps": [_last_step(seed_dir(out, s)) for s in seeds],
    }
    path = out / SEEDS_FILE
    atomic_write_text(path, json.dumps(record, indent=1))
    return path


def run_train_seeds(config: TrainConfig, seeds: list[int], run: Callable[[TrainConfig], Any] | None = None) -> Path:
    """One training run per seed into DIR/seed_<s> (``config.out`` = DIR), then DIR/config.yaml and
    DIR/train_seeds.json; return DIR.

    Each seed's run is ``config`` with that seed, so DIR/seed_<s> holds what ``grpo-lens train --seed s --out
    DIR/seed_<s>`` would. With ``config.resume`` a seed whose directory holds a run resumes it (a finished one is
    kept: nothing to train) and the others start; with ``config.overwrite`` every seed starts over.

    Args:
        config: the training settings; ``out`` required, ``seed`` ignored (each run's seed comes from ``seeds``).
        seeds: at least two distinct seeds, in the order they are run and reported.
        run: the trainer (default :func:`grpo_lens.train.loop.train`; tests may pass another).

    Raises:
        ConfigError: no --out, fewer than two seeds, DIR already holding runs without --resume or --overwrite.
    """
    run = train if run is None else run
    out, seeds = seeds_run_args("train", config.out, seeds, SEEDS_FILE)
    paths = [out / SEEDS_FILE, *(seed_dir(out, s) for s in seeds)]
    refuse_started_seeds(out, paths, config.resume, config.overwrite, "continue the seeds' runs")
    # 1) each seed's settings: resume a run that exists, start the others
    todo = []
    for s in seeds:
        sub = replace(config, seed=s, out=str(seed_dir(out, s)))
        if config.resume:
            exists = (seed_dir(out, s) / "config.yaml").is_file()
            sub = replace(sub, resume=exists, overwrite=False)
        todo.append(sub)
    # 2) the shared settings, then the seeds' runs, then the pooled record
    start_seeds_dir(out, config.to_dict())
    for sub in todo:
        logger.info("training seed %d into %s", sub.seed, sub.out)
        run(sub)
    write_seeds_record(out, seeds)
    return out
