"""``kv``: program-level KV management — admit trajectories only while the KV they use fits the engine's pool,
and keep each admitted history cached across its tool calls for as long as that tool is likely to take.

Per-trajectory async (``async``, verl's AgentLoop) starts every trajectory at once. When the histories of the
trajectories in flight exceed the engine's KV (hundreds of agents with 10–30k-token contexts on one GPU), LRU
evicts a history while its tool runs and the next turn prefills it again: on the simulated software-engineering
workload at 1,024 trajectories the engine computes 11× the unique prefill and spends more than half its time
recomputing. This policy does what ThunderAgent (program-aware admission) and Continuum (TTL pins across tool
calls) do, driven by what the rollout graph knows:

* **Admission** (``may_generate``): a trajectory that has not started waits, in batch order, while the KV in use
  — the histories of the started trajectories that are decoding or running a tool
  (:attr:`RolloutView.active_tokens`) — plus its prompt would exceed ``fill`` of the engine's KV
  (:attr:`EngineInfo.kv_tokens`), unless the KV decoding now (:attr:`RolloutView.generating_tokens`) plus its
  prompt is within ``idle_fill`` (0.5) of the pool: then the engine has room to spare, and a tool-waiting
  history the newcomer may evict costs a recompute, not an idle engine. Without that exception, on the real
  SGLang CPU server (8,192-token pool, a tiny model whose prefill is cheap) the held trajectories left the
  engine idle while the admitted ones ran tools: 0.69× of ``async``; with it the simulated software-engineering
  agent keeps its gain (1,508 s against 1,505 s without), and admitting on decoding KV alone
  (``idle_fill`` = 1) lets it thrash again (2,308 s; 0.75: 1,618 s). On one server a trajectory whose tool
  returns comes back at once (see pausing), so admitted work finishes and frees its KV; histories grow past the
  pool only by what admitted trajectories add turn by turn, and LRU then evicts the one whose tool has run
  longest (with heavy-tailed tool latencies, the one least likely to return soon). When nothing is in the
  engine, the next one is admitted whatever its size, so a history larger than the pool still runs.
* **Pausing started programs** (``pause``; ThunderAgent's program scheduler, arXiv 2602.13692): a started
  trajectory back from its tools is held at its gate unless its history passes the same admission rule; the held
  ones go on smallest history first (``resume_candidates`` names only that one, so a change re-checks one held
  trajectory, not all), and no new program starts while any is held. ``"pooled"`` (the default) pauses only
  where ``kv_tokens`` sums several pools (:attr:`EngineInfo.kv_pools`: servers behind a router). There the sum
  hides one server overflowing while others have room, and when the prompts fit the summed pools everything is
  admitted at once and the histories outgrow them: on the simulated software-engineering agent at 2,048 on 8
  servers, ``auto`` without pausing ties with ``async`` (736.3 s against 742.5 s; prefill 108.8M) and with it
  runs 578.1 s (60.1M), at 4,096 on 8 servers 998.7 s against 1,081.8 s without and 1,488.0 s for ``async``. On
  one server admission already sees the real pool and pausing only adds waits: software-engineering agent at
  1,024 1,531.7 s against 1,482.4 s, ``code-tool`` 844.5 against 819.6 s, ``search-agent`` 44.40 against
  43.35 s (``"always"`` pauses there too; ``"never"`` nowhere). Holding only past a larger fill of the pool was
  worse where pausing pays (1.5×: 700.3 s at 2,048 × 8; 2×: 736.3 s, no pause) and no better where it does not.
* **Pinning** (``keep_warm``): each request asks the engine to keep its KV for the ``quantile`` of the
  latencies seen so far of the tool its trajectory called last (learned online, per tool; before any is seen,
  ``prior_s``), times ``margin``, capped by ``max_pin_s`` (a history whose tool is slower than that is let
  go). While the KV in use exceeds ``fill`` of the pool, nothing is pinned: a pin would then evict a running
  request's KV. Where the engine reports no KV size (``EngineInfo.kv_tokens`` is None), nothing is held back
  and nothing pinned: the policy is ``async``.

Started trajectories come first at the engine (``priority``: one level above those not started).

**Where it loses** (measured on the simulated engine, README): a workload whose histories are small and whose
tools are long (``code-tool``: ~12 s python calls, 1–3k-token contexts), by 9% (820 s against 744 s): holding
programs back keeps the decode batches smaller, so the engine reads its weights in more iterations than the
recompute it saves costs (``async`` computes 8.8M prefill tokens and is busy 701 s; ``kv`` 3.9M and 773 s): with the
decoding KV capped at ``idle_fill`` of the pool, the same KV reads take more iterations, each reading the weights
again. It is admission alone: without pins 819.5 s, without the started-first priority 819.8 s,
admitting on decoding KV alone (``idle_fill`` = 1) 742.0 s — a tie there, and a thrash on the software-engineering
agent (above). Telling the two apart needs what the policy does not see: the engine's prefill cost per token
against its weight-read cost per iteration (both workloads recompute little once held back).

Risk class R1: only when requests start and what stays cached change; a request's tokens do not depend on
either (batch-invariant engine; ``rollopt validate`` checks greedy token parity).
"""

from __future__ import annotations

import heapq
from typing import Collection, Iterable

from rollopt.schedulers.base import Policy, RiskClass, RolloutView, Stage


class KVPolicy(Policy):
    name = "kv"
    risk_class = RiskClass.R1
    PAUSE = ("never", "pooled", "always")

    def __init__(self, fill: float = 1.0, quantile: float = 0.9, margin: float = 1.25, prior_s: float = 5.0,
                 max_pin_s: float = 60.0, idle_fill: float = 0.5, pause: str = "pooled") -> None:
        if not 0 < fill <= 2:
            raise ValueError(f"fill must be in (0, 2], got {fill}")
        if not 0 <= idle_fill <= fill:
            raise ValueError(f"idle_fill must be in [0, fill], got {idle_fill}")
        if pause not in self.PAUSE:
            raise ValueError(f"pause must be one of {self.PAUSE}, got {pause!r}")
        if not 0 < quantile <= 1 or margin <= 0 or prior_s < 0 or max_pin_s < 0:
            raise ValueError("quantile in (0, 1], margin > 0, prior_s >= 0, max_pin_s >= 0")
        self.fill, self.quantile, self.margin, self.prior_s, self.max_pin_s = fill, quantile, margin, prior_s, max_pin_s
        self.idle_fill, self.pause = idle_fill, pause
        self._held: list[tuple[int, str]] = []  # started trajectories held at their gate: (history tokens, id), a heap
        self._held_at: dict[str, int] = {}  # id -> the history tokens of its entry in ``_held``

    def _pauses(self, view: RolloutView) -> bool:
        """Whether started trajectories are held too (``pause``)."""
        return self.pause == "always" or (self.pause == "pooled" and view.kv_pools > 1)

    def _holds_back(self, view: RolloutView) -> bool:
        """Whether admission is controlled at all: the engine reports its KV and something is in it."""
        return view.kv_tokens is not None and view.generating > 0

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        if not self._holds_back(view):
            return True
        t = view[tid]
        if t.started:
            return self._may_resume(view, tid, t.context_tokens) if self._pauses(view) else True
        if self._pauses(view) and self._next_held(view) is not None:
            return False  # held programs resume before new ones start
        if view.first_waiting != tid:  # programs are admitted in batch order (reproducible, fair)
            return False
        return self._fits(view, t.context_tokens)

    def _may_resume(self, view: RolloutView, tid: str, tokens: int) -> bool:
        """A started trajectory back from its tools goes on if nothing is held and its history passes the admission
        rule; otherwise it is held, and the held ones go on smallest history first (pausing)."""
        first = self._next_held(view)
        if first is None and self._fits(view, tokens):
            return True
        if self._held_at.get(tid) != tokens:
            heapq.heappush(self._held, (tokens, tid))
            self._held_at[tid] = tokens
            first = self._next_held(view)
        return first == tid and self._fits(view, tokens)

    def _next_held(self, view: RolloutView) -> str | None:
        """The held trajectory with the smallest history (None: none), dropping entries of trajectories that have
        since gone on (amortized O(log held): each entry is pushed and popped once)."""
        while self._held:
            tokens, tid = self._held[0]
            t = view[tid] if tid in view else None
            if t is not None and t.live and t.started and t.stage is Stage.GATE and t.context_tokens == tokens:
                return tid
            heapq.heappop(self._held)
            if self._held_at.get(tid) == tokens:
                del self._held_at[tid]
        return None

    def _fits(self, view: RolloutView, tokens: int) -> bool:
        """The admission rule: a history of ``tokens`` fits beside the KV in use, or the engine has room to spare
        (the KV decoding now plus it within ``idle_fill`` of the pool)."""
        return (view.active_tokens + tokens <= self.fill * view.kv_tokens
                or view.generating_tokens + tokens <= self.idle_fill * view.kv_tokens)

    def admission_candidates(self, view: RolloutView, not_started: Collection[str]) -> Iterable[str]:
        """Only the first waiting trajectory in batch order can be admitted (O(1))."""
        if not self._holds_back(view):
            return not_started
        if self._pauses(view) and self._next_held(view) is not None:
            return ()
        first = view.first_waiting
        return (first,) if first is not None and first in not_started else ()

    def resume_candidates(self, view: RolloutView, paused: Collection[str]) -> Iterable[str]:
        """While pausing: only the held trajectory with the smallest history can go on (amortized O(log held))."""
        first = self._next_held(view) if self._holds_back(view) and self._pauses(view) else None
        return paused if first is None else (first,) if first in paused else ()

    def priority(self, view: RolloutView, tid: str) -> int:
        return 1 if view[tid].started else 0

    def keep_warm(self, view: RolloutView, tid: str) -> float:
        if view.kv_tokens is None or view.active_tokens > self.fill * view.kv_tokens:
            return 0.0  # the KV in use does not fit: pins would crowd out running requests' KV
        latencies, tool = view.tool_latency, view[tid].last_tool
        expected = None
        if latencies is not None:
            expected = latencies.quantile(self.quantile, tool) if tool is not None and latencies.count(tool) else \
                latencies.quantile(self.quantile)
        ttl = (self.prior_s if expected is None else expected) * self.margin
        return ttl if ttl <= self.max_pin_s else 0.0
