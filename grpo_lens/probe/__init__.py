"""``grpo-lens probe``: the gradient structure of a model for several group sizes R, and its studies.

config    :class:`ProbeConfig`, the probe's settings
run       :func:`run_probe`: sample, analyse every mixed group, aggregate, write probe.json and report.md
studies   the baseline study and the credit study
partial   :class:`PartialProbe`: what a running probe has measured so far (OUT/probe_partial/), for ``--resume``
"""

from grpo_lens.probe.config import ProbeConfig

__all__ = ["ProbeConfig", "run_probe"]


def __getattr__(name: str):
    """``run_probe``, imported when first asked for (``grpo_lens.probe.config`` is read by ``grpo-lens --help``, which
    must not load torch)."""
    if name == "run_probe":
        from grpo_lens.probe.run import run_probe

        return run_probe
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
