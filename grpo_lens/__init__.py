"""grpo-lens: train language models with GRPO and measure what GRPO's gradient is.

The layout follows the roles (docs/layout.md has one line per module):

- :mod:`grpo_lens.formulas`: every formula of docs/theory.md as a small pure function, one body each;
- :mod:`grpo_lens.gradients`: per-rollout gradients of a model, exact and sketched;
- :mod:`grpo_lens.analysis`: the one per-group analysis path the lens and the probe share;
- :mod:`grpo_lens.train`: the training loop (:func:`grpo_lens.train.loop.train`) and what it calls;
- :mod:`grpo_lens.probe`: ``grpo-lens probe`` and its studies;
- :mod:`grpo_lens.claims`: the paper's claims and their decision rules;
- :mod:`grpo_lens.report`: report.md, plots and ``grpo-lens compare``, read from a run directory alone;
- :mod:`grpo_lens.integrations`: the lens inside other trainers (TRL);
- beside them: models, rollout, rewards, tasks, lora, rundir, trackers, config, cli, demo, registry, seeding.

docs/theory.md names, under each formula, the function that computes it.

Shape letters used in every docstring: B prompts, R group size, N = B*R rollouts, T completion tokens,
P parameters.
"""

import os
import sys

#: True when torch was imported before grpo_lens with no OMP_WAIT_POLICY set: the setting below came too late and
#: OpenMP waits its own default way. Nothing warns: on an idle machine OpenMP's default, passive and spinning
#: waits measured within 10%; only on a CPU busy with other processes did spinning cost 2.3x (docs/benchmarks.md,
#: "A CPU shared with other work"), which ``export OMP_WAIT_POLICY=PASSIVE`` avoids whatever the import order.
OMP_WAIT_POLICY_TOO_LATE = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ

# OpenMP threads that spin while they wait make torch several times slower on a CPU shared with other work (2 cores,
# load 3-4: one exact-Gram group pass 26 s spinning, 4.8 s passive; benchmarks/bench_threads.py); passive waiting
# changes no number, only how idle threads wait. It must be set before torch loads OpenMP; a value set by the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: the one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]), `grpo-lens --version`
#: prints it
__version__ = "0.3.0.dev0"
