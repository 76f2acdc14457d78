"""Scheduling policies (installed as ``rollopt.schedulers``).

Every policy declares the risk class that says how far it may change what a trajectory contains
(DESIGN invariant 4); ``rollopt validate`` runs the check each class demands.
"""

from __future__ import annotations

import enum


class RiskClass(str, enum.Enum):
    """How a scheduling optimization may change learning semantics."""

    R1_TOKEN_PARITY = "R1"
    """Greedy output is token-identical to the synchronous baseline."""
    R2_DISTRIBUTION = "R2"
    """Sampled trajectories have the same distribution as the baseline's."""
    R3_OFF_POLICY = "R3"
    """Tokens may come from older weight versions; the trainer must correct for it and the run logs it."""


__all__ = ["RiskClass"]
