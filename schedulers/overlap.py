"""``overlap``: per-trajectory asynchrony. A trajectory starts its next turn as soon as its own tools are done,
so one trajectory's tools run while others decode (verl AgentLoop, slime). Inside a turn, each tool call
starts the moment its closing ``</tool_call>`` tag appears in the decode stream, while the rest of the turn
is still decoding, and parallel calls of one turn run concurrently.

Risk class R1: with a batch-invariant engine, greedy tokens do not depend on batch composition, and a tool's
result does not depend on when it started, so every trajectory's tokens equal the ``sync`` run's.
"""

from __future__ import annotations

from rollopt.schedulers.base import Policy, RiskClass


class OverlapPolicy(Policy):
    name = "overlap"
    risk_class = RiskClass.R1
    early_tool_start = True
