"""The paper's claims (arXiv 2606.29238), each tested against the lens's numbers with a verdict computed by a rule.

base       :class:`Claim`, the registry :data:`CLAIMS`, the two verdict helpers (band, one control), the claims'
           number formatting and :func:`evaluate_claims`
rank       effective rank ≈ 2
zero_sum   rank 2 from the zero-sum advantages (G1 permutation test, G2 weightings)
identity   the rank-2 identity
sparsity   sparsity intensifies over training; most parameters unchanged (a training run's records)
credit     every token gets the same credit; uniform vs Monte Carlo credit (a probe's credit study)
baselines  the group mean is the optimal baseline (a probe's baseline study)

Importing this package registers every claim family. Decision rules: docs/theory.md §11, §12.
"""

from grpo_lens.claims import baselines, credit, identity, rank, sparsity, zero_sum  # noqa: F401 (they register)
from grpo_lens.claims.base import (
    CLAIMS,
    DOES_NOT_HOLD,
    HOLDS,
    INCONCLUSIVE,
    VERDICTS,
    Claim,
    evaluate_claims,
)

__all__ = ["CLAIMS", "DOES_NOT_HOLD", "HOLDS", "INCONCLUSIVE", "VERDICTS", "Claim", "evaluate_claims"]
