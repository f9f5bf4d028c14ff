"""``grpo-lens probe``: the gradient structure of a model for several group sizes R, and its studies.

config    :class:`ProbeConfig`, the probe's settings
run       :func:`grpo_lens.probe.run.run_probe`: sample, analyse every mixed group, aggregate, write probe.json and
          report.md
studies   the baseline study and the credit study
partial   :class:`PartialProbe`: what a running probe has measured so far (OUT/probe_partial/), for ``--resume``

The package imports only :mod:`grpo_lens.probe.config`: ``grpo-lens --help`` reads it and must not load torch.
"""

from grpo_lens.probe.config import ProbeConfig

__all__ = ["ProbeConfig"]
