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
  (``idle_fill`` = 1) lets it thrash again (2,308 s; 0.75: 1,618 s). A trajectory whose tool returns comes back
  at once (started ones are never held), so admitted work finishes and frees its KV; histories grow past the
  pool only by what admitted trajectories add turn by turn, and LRU then evicts the one whose tool has run
  longest (with heavy-tailed tool latencies, the one least likely to return soon). When nothing is in the engine, the next one is admitted
  whatever its size, so a history larger than the pool still runs.
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

from typing import Collection, Iterable

from rollopt.schedulers.base import Policy, RiskClass, RolloutView


class KVPolicy(Policy):
    name = "kv"
    risk_class = RiskClass.R1

    def __init__(self, fill: float = 1.0, quantile: float = 0.9, margin: float = 1.25, prior_s: float = 5.0,
                 max_pin_s: float = 60.0, idle_fill: float = 0.5) -> None:
        if not 0 < fill <= 2:
            raise ValueError(f"fill must be in (0, 2], got {fill}")
        if not 0 <= idle_fill <= fill:
            raise ValueError(f"idle_fill must be in [0, fill], got {idle_fill}")
        if not 0 < quantile <= 1 or margin <= 0 or prior_s < 0 or max_pin_s < 0:
            raise ValueError("quantile in (0, 1], margin > 0, prior_s >= 0, max_pin_s >= 0")
        self.fill, self.quantile, self.margin, self.prior_s, self.max_pin_s = fill, quantile, margin, prior_s, max_pin_s
        self.idle_fill = idle_fill

    def _holds_back(self, view: RolloutView) -> bool:
        """Whether admission is controlled at all: the engine reports its KV and something is in it."""
        return view.kv_tokens is not None and view.generating > 0

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        t = view[tid]
        if t.started or not self._holds_back(view):
            return True
        if view.first_waiting != tid:  # programs are admitted in batch order (reproducible, fair)
            return False
        return self._fits(view, t.context_tokens)

    def _fits(self, view: RolloutView, tokens: int) -> bool:
        """The admission rule: a history of ``tokens`` fits beside the KV in use, or the engine has room to spare
        (the KV decoding now plus it within ``idle_fill`` of the pool)."""
        return (view.active_tokens + tokens <= self.fill * view.kv_tokens
                or view.generating_tokens + tokens <= self.idle_fill * view.kv_tokens)

    def admission_candidates(self, view: RolloutView, not_started: Collection[str]) -> Iterable[str]:
        """Only the first waiting trajectory in batch order can be admitted (O(1))."""
        if not self._holds_back(view):
            return not_started
        first = view.first_waiting
        return (first,) if first is not None and first in not_started else ()

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
