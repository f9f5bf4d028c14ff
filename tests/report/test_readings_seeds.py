"""The readings table of a pooled probe: G3 (one matrix per R and seed, not pooled) as the range over the seeds."""

from __future__ import annotations

from grpo_lens.report import readings


def _g3(measure: str, by_r: dict[str, float]) -> dict:
    return {
        "matrix": "G3 (rows = groups' updates)",
        "measure": measure,
        "primary": False,
        "by_size": {R: {"mean": v, "lo": None, "hi": None, "n": 25} for R, v in by_r.items()},
        "near_two": "one matrix: no interval",
        "controls": {},
    }


def test_g3_of_a_pooled_probe_is_the_range_over_its_seeds(monkeypatch):
    # three seeds' stable ranks at R = 4 / 8 (the decide run's: 5.98 / 5.74, 2.02 / 3.94, 3.33 / 3.32): the range is
    # min-max over the seeds per R, 2.02-5.98 and 3.32-5.74; a seed without G3 leaves G3 out (no partial range)
    seeds = [{"sr": {"4": 5.98, "8": 5.74}}, {"sr": {"4": 2.02, "8": 3.94}}, {"sr": {"4": 3.33, "8": 3.32}}]
    monkeypatch.setattr(readings, "rank_readings", lambda p: [_g3("stable_rank", p["sr"])] if "sr" in p else [])
    rows = readings.seed_g3_rows(seeds, ["4", "8"])
    assert rows == [
        "| G3 (rows = groups' updates), stable rank, range over seeds | 2.02–5.98 (3 seeds) | 3.32–5.74 (3 seeds) "
        "| one matrix per seed: no interval |"
    ]
    assert readings.seed_g3_rows([*seeds, {}], ["4", "8"]) == []
    assert readings.seed_g3_rows(seeds[:1], ["4", "8"]) == []  # one seed: its own report's G3 row, no range
