"""Dense: the full KV of every head stays on the device and every decode step reads all of it."""
from __future__ import annotations

from dataclasses import dataclass

from systems.policies.base import Policy


@dataclass
class Dense(Policy):
    """No hyperparameters; the base hooks already mean 'keep everything, read everything'."""

    name = "dense"
    full_cache = True


POLICY = Dense
