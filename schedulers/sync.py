"""``sync``: batch-synchronous turns, the classic multi-turn loop (verl's older SGLang multi-turn rollout):
every live trajectory generates turn t, then every tool call of turn t runs, then turn t+1 starts. Tools
start only after the whole turn is decoded. The baseline every other policy is measured and checked against.
"""

from __future__ import annotations

from rollopt.schedulers.base import Policy, RiskClass, RolloutView


class SyncPolicy(Policy):
    name = "sync"
    risk_class = RiskClass.R1
    barrier = True

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        """Turn t starts once no live trajectory is still in turn t-1 (its generation or its tools)."""
        me = view[tid]
        return view.min_live_turn is None or me.turn <= view.min_live_turn

    def may_run_tools(self, view: RolloutView, tid: str) -> bool:
        """Turn t's tools start once every live trajectory has finished decoding turn t: none is in an earlier
        turn, and every live one in turn t is running its tools."""
        me = view[tid]
        return me.turn <= view.min_live_turn and view.live_not_in_tools(me.turn) == 0
