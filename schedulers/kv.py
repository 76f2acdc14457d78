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
* **A floor under the decode batch** (``min_decoding``, 16): on one server whose pool cannot hold that many
  histories of the size decoding now (their mean), while fewer than that many requests decode, the next program is
  admitted whatever the KV in use. There holding programs back keeps the decode batch at a few rows, and an
  iteration's fixed cost (the weights read, the step launched) spread over so few tokens costs more than the
  recompute held back saves. Where the pool holds enough histories, a small batch means programs are in their
  tools, and the KV rule decides (with the floor there too, 256 simulated agents against a 200k-token pool
  recomputed 3.6–4.0M tokens against 3.2–3.5M). On the real
  SGLang CPU server under KV pressure (64 software-engineering agents, ~3.2k-token histories, an 8,192-token pool)
  ``kv`` went from 0.97× of ``async`` [0.94–0.98] to 1.03× [0.85–1.04] (the sim fitted to that server: 0.91× to
  0.99×); on the embedded engine it is a tie too (0.99× [0.96–1.06]; 1.03× without, on 2026-12-06); the
  simulated workloads at 1,024 on one H200 keep their figures to the digit (their pools hold dozens of histories,
  so the floor never binds). Behind a router, where each pool is sized alone, it does not apply.
* **Pausing started programs** (``pause``; ThunderAgent's program scheduler, arXiv 2602.13692): a started
  trajectory back from its tools is held at its gate unless its history passes the same admission rule; the held
  ones go on smallest history first (``resume_candidates`` names only that one per pool, so a change re-checks
  one held trajectory a pool, not all), and no new program starts in a pool while any is held there. ``"pooled"``
  (the default) pauses only behind a router (:attr:`EngineInfo.kv_pools` > 1): when the prompts fit the pools
  everything is admitted at once and the histories outgrow them (software-engineering agent at 2,048 on 8
  servers: ``auto`` without pausing tied with ``async``, 736.3 s against 742.5 s, prefill 108.8M). On one
  server admission already sees the real pool and pausing only adds waits: software-engineering agent at 1,024
  1,531.7 s against 1,482.4 s, ``code-tool`` 844.5 against 819.6 s, ``search-agent`` 44.40 against 43.35 s
  (``"always"`` pauses there too; ``"never"`` nowhere). Holding only past a larger fill of the pool was worse
  where pausing pays (1.5×: 700.3 s at 2,048 × 8; 2×: 736.3 s, no pause) and no better where it does not;
  resuming the largest history first instead of the smallest (for the tail) took 598.9 s at 2,048 × 8 against
  544.5 s.
* **Placing programs in pools** (``place``, on by default; behind a router): ``kv_tokens`` then sums several
  servers' pools, and the sum hides one server overflowing while others have room (with the pools summed,
  pausing reached 595.8 s at 2,048 × 8 and 998.7 s at 4,096 × 8, prefill 64.9M and 92.0M). So every rule above
  is applied per pool (each ``kv_tokens / kv_pools``, its KV in use counted from the trajectories placed there:
  :meth:`RolloutView.pool_active_tokens`), and the policy places the programs itself (:meth:`kv_pool`, which the
  executor sends as ``GenerateRequest.kv_pool`` and the router obeys): a new group goes to the pool with the
  least KV in use among those holding nobody, its members follow it (the prompt is in that server's cache), and
  a held history whose own pool stays full moves to a pool that has room for it beside what is in use there (its
  history is prefilled there again — instead of waiting). Without moving, groups placed when their histories
  were still prompts grew unevenly and the servers were busy 382–748 s (771.4 s at 2,048 × 8, worse than
  ``async``); with it 432–480 s. Measured (one seeded run each, README): 2,048 × 8 544.5 s, 4,096 × 8 921.3 s.
* **Pinning** (``keep_warm``): each request asks the engine to keep its KV for the ``quantile`` of the
  latencies seen so far of the tool its trajectory called last (learned online, per tool; before any is seen,
  ``prior_s``), times ``margin``, capped by ``max_pin_s`` (a history whose tool is slower than that is let
  go). While the KV in use exceeds ``fill`` of the pool (its own pool, when placing), nothing is pinned: a pin
  would then evict a running request's KV. Where the engine reports no KV size (``EngineInfo.kv_tokens`` is None), nothing is held back
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
On the real SGLang CPU server under KV pressure (64 software-engineering agents scaled to ~3.2k-token histories, an
8,192-token pool) it was 3% slower than ``async`` with 43% less prefill until the floor under the decode batch
(above): that pool holds ~2.5 histories, so holding back left decode batches of a few rows.

**Where the guards cost** (README, *Where recompute binds on a real engine*): the ``idle_fill`` exception and the
``min_decoding`` floor protect engines on which a few-row decode iteration costs nearly a full one (a GPU reads its
weights every iteration; the SGLang CPU server spends ~3 ms an iteration in its scheduler). On the embedded engine an
iteration's fixed cost is ~0.8 ms, so they only admit programs whose KV evicts others': 128 and 256 agents against
a 16,384-token cache, ``auto`` 1.18× and 1.21× over ``async``, ``auto[idle_fill=0,min_decoding=0]`` 1.30× and 1.35×
with half the prefill — and on the SGLang server the same options lose (0.81× at 64 agents, 8,192 tokens), and at
128 agents against 16,384 tokens the default gave 0.89× in one run and 1.03× in the next (``auto``): there 16 rows
decode at ~60% of a full batch's rate and recompute is cheap. No engine reports those costs to the policy yet, so
the defaults stay and the options are the user's to set.

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
                 max_pin_s: float = 60.0, idle_fill: float = 0.5, pause: str = "pooled",
                 place: bool = True, min_decoding: int = 16) -> None:
        if not 0 < fill <= 2:
            raise ValueError(f"fill must be in (0, 2], got {fill}")
        if not 0 <= idle_fill <= fill:
            raise ValueError(f"idle_fill must be in [0, fill], got {idle_fill}")
        if pause not in self.PAUSE:
            raise ValueError(f"pause must be one of {self.PAUSE}, got {pause!r}")
        if not 0 < quantile <= 1 or margin <= 0 or prior_s < 0 or max_pin_s < 0:
            raise ValueError("quantile in (0, 1], margin > 0, prior_s >= 0, max_pin_s >= 0")
        self.fill, self.quantile, self.margin, self.prior_s, self.max_pin_s = fill, quantile, margin, prior_s, max_pin_s
        if min_decoding < 0:
            raise ValueError(f"min_decoding must be >= 0, got {min_decoding}")
        self.idle_fill, self.pause, self.place, self.min_decoding = idle_fill, pause, place, min_decoding
        # started trajectories held at their gate, per KV pool (None: the one pool it sizes by): heaps of
        # (history tokens, id); ``_held_at``: id -> the history tokens of its entry
        self._held: dict[int | None, list[tuple[int, str]]] = {}
        self._held_at: dict[str, int] = {}
        self._group_pool: dict[str, int] = {}  # group -> the KV pool its members run in (placing)

    def _pauses(self, view: RolloutView) -> bool:
        """Whether started trajectories are held too (``pause``)."""
        return self.pause == "always" or (self.pause == "pooled" and view.kv_pools > 1)

    def _places(self, view: RolloutView) -> bool:
        """Whether it places programs in the pools itself and sizes each pool's working set (``place``)."""
        return self.place and view.kv_pools > 1 and view.kv_tokens is not None

    def _holds_back(self, view: RolloutView) -> bool:
        """Whether admission is controlled at all: the engine reports its KV and something is in it."""
        return view.kv_tokens is not None and view.generating > 0

    def _pool_of(self, view: RolloutView, tid: str) -> int | None:
        """The pool ``tid`` runs in (None: not placing): a started one's own, else its group's, else the pool a new
        group would go to (:meth:`_least_used_pool`)."""
        if not self._places(view):
            return None
        t = view[tid]
        if t.started and t.kv_pool is not None:
            return t.kv_pool
        pool = self._group_pool.get(t.group_id)
        if pool is None:  # a new group: the least used pool holding nobody, else the least used
            pool = self._least_used_pool(view)
            return pool if pool is not None else min(range(view.kv_pools), key=lambda p: (self._kv(view, p)[1], p))
        return pool

    def _least_used_pool(self, view: RolloutView, room_for: int | None = None) -> int | None:
        """The pool with the least KV in use among those holding nobody and, given ``room_for``, with room for that
        many tokens beside what is in use there (None: no such pool; O(pools))."""
        pools = [p for p in range(view.kv_pools) if self._next_held(view, p) is None]
        if room_for is not None:
            pools = [p for p in pools if self._kv(view, p)[1] + room_for <= self.fill * self._kv(view, p)[0]]
        return min(pools, key=lambda p: (self._kv(view, p)[1], p), default=None)

    def _kv(self, view: RolloutView, pool: int | None) -> tuple[float, int, int]:
        """(size, KV in use, KV decoding now) of ``pool``, in tokens (None: the engine's one pool, or all summed)."""
        if pool is None:
            return view.kv_tokens, view.active_tokens, view.generating_tokens
        return view.kv_tokens / view.kv_pools, view.pool_active_tokens(pool), view.pool_generating_tokens(pool)

    def kv_pool(self, view: RolloutView, tid: str) -> int | None:
        """Placing: a group's members all run in the pool its first admitted member went to (they share its prompt
        in that server's prefix cache), except a held history that ``may_generate`` let go on in another pool
        because its own stays full: asked on the same view, the same rule names that pool again."""
        pool = self._pool_of(view, tid)
        t = view[tid]
        if (pool is not None and t.started and t.stage is Stage.GATE and self._pauses(view)
                and not self._fits(view, t.context_tokens, pool)):
            return self._least_used_pool(view, room_for=t.context_tokens)  # where it fits (see _may_resume)
        if pool is not None:
            if len(self._group_pool) > 2 * len(view.trajectories):  # groups of earlier batches (amortized O(1))
                live = set(view.group_order)
                self._group_pool = {g: p for g, p in self._group_pool.items() if g in live}
            self._group_pool.setdefault(view[tid].group_id, pool)
        return pool

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        if not self._holds_back(view):
            return True
        t = view[tid]
        pool = self._pool_of(view, tid)
        if t.started:
            return self._may_resume(view, tid, t.context_tokens, pool) if self._pauses(view) else True
        if self._pauses(view) and self._next_held(view, pool) is not None:
            return False  # held programs resume before new ones start in their pool
        if view.first_waiting != tid:  # programs are admitted in batch order (reproducible, fair)
            return False
        return self._fits(view, t.context_tokens, pool)

    def _may_resume(self, view: RolloutView, tid: str, tokens: int, pool: int | None) -> bool:
        """A started trajectory back from its tools goes on if nothing is held in its pool and its history passes
        the admission rule; otherwise it is held, and the held ones go on smallest history first (pausing)."""
        first = self._next_held(view, pool)
        if first is None and self._fits(view, tokens, pool):
            return True
        if self._held_at.get(tid) != tokens:
            heapq.heappush(self._held.setdefault(pool, []), (tokens, tid))
            self._held_at[tid] = tokens
            first = self._next_held(view, pool)
        if first != tid:
            return False
        if self._fits(view, tokens, pool):
            return True
        # placing: it goes on in a pool with room for it (its history is prefilled there again) instead of waiting
        # for its own; ``kv_pool`` names that pool by the same rule
        return pool is not None and self._least_used_pool(view, room_for=tokens) is not None

    def _next_held(self, view: RolloutView, pool: int | None) -> str | None:
        """The trajectory held in ``pool`` with the smallest history (None: none), dropping entries of trajectories
        that have since gone on (amortized O(log held): each entry is pushed and popped once)."""
        held = self._held.get(pool)
        while held:
            tokens, tid = held[0]
            t = view[tid] if tid in view else None
            if t is not None and t.live and t.started and t.stage is Stage.GATE and t.context_tokens == tokens:
                return tid
            heapq.heappop(held)
            if self._held_at.get(tid) == tokens:
                del self._held_at[tid]
        return None

    def _fits(self, view: RolloutView, tokens: int, pool: int | None) -> bool:
        """The admission rule: a history of ``tokens`` fits beside the KV in use in ``pool`` (None: the engine's
        one pool, or all of them summed), or that pool has room to spare (the KV decoding now plus it within
        ``idle_fill`` of the pool; a placed pool with nothing decoding takes it whatever its size; one server's
        pool while fewer than ``min_decoding`` requests decode and it could not hold ``min_decoding`` histories of
        their mean size)."""
        size, active, generating = self._kv(view, pool)
        if pool is not None and generating == 0:
            return True
        if view.kv_pools == 1 and 0 < view.generating < self.min_decoding and \
                view.generating_tokens * self.min_decoding > view.generating * size:
            return True  # the pool cannot hold min_decoding such histories: holding back would keep the batch small
        return active + tokens <= self.fill * size or generating + tokens <= self.idle_fill * size

    def admission_candidates(self, view: RolloutView, not_started: Collection[str]) -> Iterable[str]:
        """Only the first waiting trajectory in batch order can be admitted (O(1))."""
        if not self._holds_back(view):
            return not_started
        first = view.first_waiting
        if first is None or first not in not_started:
            return ()
        if self._pauses(view) and self._next_held(view, self._pool_of(view, first)) is not None:
            return ()
        return (first,)

    def resume_candidates(self, view: RolloutView, paused: Collection[str]) -> Iterable[str]:
        """While pausing: only the held trajectory with the smallest history in each pool can go on (amortized
        O(pools · log held))."""
        if not (self._holds_back(view) and self._pauses(view)):
            return paused
        firsts = [first for pool in list(self._held) if (first := self._next_held(view, pool)) is not None]
        return [first for first in firsts if first in paused] if firsts else paused

    def priority(self, view: RolloutView, tid: str) -> int:
        return 1 if view[tid].started else 0

    def keep_warm(self, view: RolloutView, tid: str) -> float:
        if view.kv_tokens is None:
            return 0.0
        size, active, _ = self._kv(view, view[tid].kv_pool if self._places(view) else None)
        if active > self.fill * size:
            return 0.0  # the KV in use does not fit: pins would crowd out running requests' KV
        latencies, tool = view.tool_latency, view[tid].last_tool
        expected = None
        if latencies is not None:
            expected = latencies.quantile(self.quantile, tool) if tool is not None and latencies.count(tool) else \
                latencies.quantile(self.quantile)
        ttl = (self.prior_s if expected is None else expected) * self.margin
        return ttl if ttl <= self.max_pin_s else 0.0
