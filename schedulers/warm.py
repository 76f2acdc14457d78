"""``warm``: keep a trajectory's KV cached across its tool calls.

Between two turns a trajectory leaves the engine while its tools run; its history (prompt and every turn so
far) stays in the prefix cache only as long as LRU eviction spares it. Under memory pressure (many
trajectories, long histories, slow tools) the next turn then recomputes the whole history. This policy asks
the engine to pin each request's KV for ``keep_warm_s`` seconds after it ends, or until the trajectory's
next turn reuses it (``GenerateRequest.keep_warm_s``; the embedded engine pins prefix-cache blocks). A tool
call slower than the TTL loses the pin and falls back to LRU, so a pin can never hold memory forever.

Risk class R1: only what is cached changes, not what is computed from it; with the batch-invariant engine and
invariant prefill, KV from the cache is bit-identical to recomputed KV (``rollopt validate`` checks parity).
"""

from __future__ import annotations

from rollopt.schedulers.base import Policy, RiskClass


class WarmPolicy(Policy):
    name = "warm"
    risk_class = RiskClass.R1

    def __init__(self, keep_warm_s: float = 30.0) -> None:
        if not keep_warm_s > 0:
            raise ValueError("keep_warm_s must be > 0")
        self.keep_warm_s = keep_warm_s
