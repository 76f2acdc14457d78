"""``prefix``: share prefixes across branching trajectories. Before the members of a GRPO group (or the
branches of a tree fork) start, their shared prefix is prefilled once (a ``max_new_tokens=0`` request), so
every child finds it in the engine's prefix cache; requests are prioritized by group so that members of one
group run together while their prefix is hot (cache affinity). The engine's ``cached_tokens`` and prefill
counters prove the saving.

Risk class R1: cached KV equals recomputed KV up to float rounding; tests check greedy token parity.
"""

from __future__ import annotations

from rollopt.schedulers.base import Policy, RiskClass, RolloutView


class PrefixPolicy(Policy):
    name = "prefix"
    risk_class = RiskClass.R1
    shared_prefill = True

    def priority(self, view: RolloutView, tid: str) -> int:
        """Earlier groups first, so one group's members are admitted together (higher = sooner)."""
        order = view.group_order
        return len(order) - order.index(view[tid].group_id)
