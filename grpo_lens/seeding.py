"""Seeding shared by the trainer, the probe and the demo (a neutral module: the probe must not import the trainer)."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy and torch with ``seed`` (numpy gets ``seed mod 2**32``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
