"""The report's gradient-noise-scale and dead-group lines, from metrics.jsonl records alone."""

from __future__ import annotations

from grpo_lens.report.training_measures import noise_and_dead_section


def test_noise_and_dead_section_reads_the_records():
    dead = {
        "dead/all_correct_groups": 1,
        "dead/all_wrong_groups": 2,
        "dead/all_equal_other_groups": 0,
        "dead/mixed_groups": 5,
        "dead/normalizer_share": 0.25,
        "dead/steps_without_mixed": 0,
    }
    records = [
        {"step": 1, **dead},
        {
            "step": 2,
            **dead,
            "dead/normalizer_share": 0.75,
            "dead/steps_without_mixed": 3,
            "noise/groups": 8.0,
            "noise/grad_sq": 0.5,
            "noise/grad_sq_lo": 0.1,
            "noise/grad_sq_hi": 0.9,
            "noise/trace_sigma": 2.0,
            "noise/b_simple": 4.0,
            "noise/b_simple_lo": 1.5,
            "noise/b_simple_hi": 9.25,
            "noise/snr": 2.0,
            "noise/grad_sq_p": 0.01,
            "noise/from_update": 0.0,
        },
    ]
    findings: list[str] = []
    text = "\n".join(noise_and_dead_section(records, findings))
    # totals over the 2 steps: 10 mixed, 2 all correct, 4 all wrong; mean share (0.25 + 0.75) / 2 = 0.5; longest 3
    assert "10 groups with reward contrast, 2 all correct, 4 all wrong" in text
    assert "0.500 of the loss normaliser" in text and "without a mixed group: 3" in text
    assert "| 2 | 8 | 0.5000 [0.1000, 0.9000] | 2.0000 | 4.00 [1.50, 9.25] | 2.00 | 0.010 | – | Gram |" in text
    assert findings[-1].startswith("Gradient noise scale at step 2: B_simple 4.00 [1.50, 9.25] groups against B = 8")
    assert noise_and_dead_section([{"step": 1}], []) == []  # a run without the keys: no section
