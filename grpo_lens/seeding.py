"""Seeding shared by the trainer, the probe and the demo (a neutral module: the probe must not import the trainer).

- :func:`seed_everything`: seed python's ``random``, numpy and torch once, at the start of a command.
- :func:`derive_seed`: the one formula that derives a seed from (seed, parts): a step's, a batch of prompts', a
  layer's projections', so that a part is the same whenever it is drawn (what ``--resume`` relies on).
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch

#: the multiplier of the run's seed in :func:`derive_seed` (a prime above any part's term)
SEED_MULTIPLIER = 1_000_003

#: the multiplier of each counted part of :func:`derive_seed` (primes; ``offset`` is added as it is)
PART_MULTIPLIERS = {"group_size": 10_007, "draw": 7_919, "step": 7_919, "offset": 1}

#: the modulus of a derived seed that is used as an int32-safe seed (sampling, prompts, steps)
SEED_MODULUS = 2**31 - 1


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy and torch with ``seed`` (numpy gets ``seed mod 2**32``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derive_seed(seed: int, *names: str, modulus: int = SEED_MODULUS, **parts: int) -> int:
    """A seed derived from the run's ``seed`` and the parts that identify what it seeds:

        (seed · 1_000_003 + Σ_k m_k · parts[k] + Σ_j crc32(names[j])) mod ``modulus``

    with m_k of :data:`PART_MULTIPLIERS` (group_size 10_007, draw and step 7_919, offset 1). The batch of prompts
    ``draw`` of group size R in the probe is ``derive_seed(seed, group_size=R, draw=draw)``, a training step's
    ``derive_seed(seed, step=step)``, a layer's sketch projections ``derive_seed(seed, name, modulus=2**63)``
    (crc32 of the UTF-8 name: stable across processes, unlike ``hash``).

    Args:
        seed: the run's seed (``--seed``).
        names: strings that identify what is seeded (parameter or layer names).
        modulus: 2**31 − 1 (the default, :data:`SEED_MODULUS`) or 2**63 for a ``torch.Generator``.
        parts: counted parts, each a keyword of :data:`PART_MULTIPLIERS`.

    Returns:
        an int in [0, modulus).

    Raises:
        ValueError: a part that is not a keyword of :data:`PART_MULTIPLIERS` (listing them).
    """
    unknown = sorted(set(parts) - set(PART_MULTIPLIERS))
    if unknown:
        raise ValueError(f"unknown seed part(s) {', '.join(unknown)}; valid: {', '.join(PART_MULTIPLIERS)}")
    total = seed * SEED_MULTIPLIER + sum(PART_MULTIPLIERS[k] * v for k, v in parts.items())
    return (total + sum(zlib.crc32(n.encode()) for n in names)) % modulus
