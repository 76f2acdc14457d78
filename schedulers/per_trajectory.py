"""``async``: per-trajectory asynchrony only. A trajectory starts its next turn as soon as its own tools are
done, so one trajectory's tools overlap other trajectories' decoding, but a turn's tools start only after the
turn is fully decoded. This is the rollout loop of verl's AgentLoop and slime (one coroutine per sample), kept
as a named baseline; ``overlap`` adds in-turn tool start on top.

Risk class R1, for the same reason as ``overlap``.
"""

from __future__ import annotations

from rollopt.schedulers.base import Policy, RiskClass


class AsyncPolicy(Policy):
    name = "async"
    risk_class = RiskClass.R1
