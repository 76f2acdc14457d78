"""``auto``: the policy to pick when you do not know better — ``overlap+kv``.

Each tool call starts as soon as its ``</tool_call>`` closes in the decode stream (``overlap``), and, where the
engine reports its KV size, trajectories are admitted while the KV in use fits the pool and each history is pinned
across its tool call (``kv``); behind a router (several KV pools) ``kv`` places each group on a server and sizes
every server's pool on its own, and started trajectories are also held while their history does not fit (``kv``'s
placing and pausing). On an engine that reports no KV size it is ``overlap``. Chosen from the measured tables in
README (side by side with ``async``, verl's AgentLoop): on the simulated software-engineering agent it is the
fastest policy measured — 1.93× at 1,024 trajectories on one server, 1.62× at 4,096 on 8 servers (1.49× with the
pools summed, 1.38× without pausing), 1.36× at 2,048 on 8 servers (a tie without either) — on the search-agent and
single-turn reasoning workloads and on every embedded-engine workload it ties with ``async`` (reasoning at 4,096 on
8 servers: 1.06×), and on the tool-chain-bound ``code-tool`` workload on one server it is 9% slower than ``async``
(see ``kv``: where it loses); on the real engines under KV pressure (64 agents, an 8,192-token pool) it ties with
``async`` (README; 6% slower on SGLang before ``kv``'s floor under the decode batch); with 128 agents against 16,384
tokens it is 1.18× faster than ``async`` on the embedded engine (1.30× as ``auto[idle_fill=0,min_decoding=0]``) and
**0.89× of ``async`` on the SGLang CPU server** in one run (1.03× in a rerun), whose few-row iterations are dear (see
``kv``: where the guards cost).
``kv``'s ``idle_fill`` and ``min_decoding`` pass through (``auto[idle_fill=0,min_decoding=0]``).

Risk class R1: both parts are R1.
"""

from __future__ import annotations

from rollopt.schedulers.base import CompositePolicy, RiskClass
from rollopt.schedulers.kv import KVPolicy
from rollopt.schedulers.overlap import OverlapPolicy


class AutoPolicy(CompositePolicy):
    name = "auto"
    risk_class = RiskClass.R1

    def __init__(self, fill: float = 1.0, pause: str = "pooled", place: bool = True, idle_fill: float = 0.5,
                 min_decoding: int = 16) -> None:  # kv's options
        super().__init__([OverlapPolicy(), KVPolicy(fill=fill, pause=pause, place=place, idle_fill=idle_fill,
                                                    min_decoding=min_decoding)])
        self.name = "auto"  # type: ignore[misc]
