"""A probe, not a shipped policy: ``auto`` plus ThunderAgent's pause of *started* programs, on the simulated engine.

    .venv/bin/python bench/probe_pause_started.py --workload swe-agent --trajectories 2048 --servers 8 \
        --schedulers auto-pause --repeats 1 --out bench/results/probe-pause-started

Registers ``auto-pause`` in this process only and runs ``bench/agentic_sim.py`` with the same arguments (any of its
schedulers may be named beside it). ``kv`` never holds a started trajectory: one back from its tool call sends its
next turn at once, and when the histories of the admitted programs outgrow the KV the engine's LRU thrashes. Here,
as ThunderAgent's program scheduler does (arXiv 2602.13692; NVIDIA Dynamo's ``thunderagent_router``), a started
trajectory back from its tools also waits at its gate unless its history passes ``kv``'s admission rule
(``KVPolicy._fits``: it fits beside the KV in use, or the decoding KV plus it is within ``idle_fill`` of the pool),
the paused ones resume smallest history first, and no new program is admitted while any is paused. Risk class R1:
only when requests start changes.

Measured 2026-12-07 (one seeded run each, H200 roofline, llama-3.1-8b, virtual seconds; README), in runs separate
from ``async``'s and ``auto``'s in ``bench/results/agentic-swe-agent-*``: a seeded simulated run repeats exactly
(this script reproduced the exploratory runs to the last digit), so they compare as if side by side: swe-agent 2,048
on 8 servers 578.1 s against ``async`` 742.5 s and ``auto`` 736.3 s (1.28×), prefill 60.1M against 108.8M,
efficiency 0.62 against 0.48 (the bound 356.1 s); at 1,024 on one server 1,531.7 s against ``auto``'s 1,482.4 s (3%
slower; 1.87× over ``async``). Pausing first come first served instead of smallest first, with new programs admitted
beside paused ones: 1,973.8 s at 1,024.

Not yet a policy: each state change wakes every paused trajectory (O(paused)); ``code-tool`` and the embedded
engine were not measured; the heap is state the policy keeps across batches (stale entries are dropped lazily).
"""

from __future__ import annotations

import heapq
import sys
from pathlib import Path

from rollopt.schedulers import RiskClass, RolloutView, Stage, register_scheduler
from rollopt.schedulers.base import CompositePolicy
from rollopt.schedulers.kv import KVPolicy
from rollopt.schedulers.overlap import OverlapPolicy


class PauseStartedKVPolicy(KVPolicy):
    """``kv`` whose admission rule also gates started trajectories, resuming the smallest paused history first."""

    name = "kv-pause"
    risk_class = RiskClass.R1

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._paused: list[tuple[int, str]] = []  # (history tokens when paused, trajectory id): a min-heap
        self._queued: set[str] = set()

    def _smallest_paused(self, view: RolloutView) -> str | None:
        """The paused trajectory with the smallest history, dropping entries that are no longer paused."""
        while self._paused:
            tokens, tid = self._paused[0]
            t = view[tid] if tid in view else None
            if t is not None and t.live and t.started and t.stage is Stage.GATE and t.context_tokens == tokens:
                return tid
            heapq.heappop(self._paused)
            self._queued.discard(tid)
        return None

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        if not self._holds_back(view):
            return True
        t, first = view[tid], self._smallest_paused(view)
        if not t.started:
            return first is None and super().may_generate(view, tid)
        if first is None and self._fits(view, t.context_tokens):
            return True
        if tid not in self._queued:
            heapq.heappush(self._paused, (t.context_tokens, tid))
            self._queued.add(tid)
            first = self._smallest_paused(view)
        return first == tid and self._fits(view, t.context_tokens)


class AutoPausePolicy(CompositePolicy):
    name = "auto-pause"
    risk_class = RiskClass.R1

    def __init__(self) -> None:
        super().__init__([OverlapPolicy(), PauseStartedKVPolicy()])
        self.name = "auto-pause"  # type: ignore[misc]


if __name__ == "__main__":
    register_scheduler(AutoPausePolicy.name, AutoPausePolicy)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import agentic_sim

    agentic_sim.main()
