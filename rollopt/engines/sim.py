"""The simulated engine: SGLang's scheduling and KV mechanics on a virtual clock, timed by a cost model.

It runs no model. A ``script(request) -> list[int]`` gives each request's tokens (default: ``max_new_tokens``
ids of :func:`sampled_text`, distinct per request as a sampled model's text is; or copies of ``filler_token``),
and each iteration lasts what its cost model (:mod:`rollopt.engines.sim_cost`) says:
the loop ``await anyio.sleep(seconds)``, so under trio's ``MockClock(autojump_threshold=0)`` virtual time jumps
over iterations and tool waits alike, and thousands of trajectories run in seconds of wall time. Durations are
rounded up to whole ticks of 2⁻³⁰ s (:mod:`rollopt.engines.virtual_clock`), so virtual times add exactly and a
run's schedule does not depend on when it started.

Mechanics (as SGLang 0.5.23 does them, simplified):

* **KV pool**: ``kv_tokens`` of capacity in pages of ``block_size`` tokens. A running request holds a locked
  chain of cached pages (its prefix) plus private pages; prefix-cache pages count against the same pool.
* **Prefix cache**: pages keyed by a hash chained over their tokens (equal keys, tokens and parent = equal
  prefix). Unlocked, unpinned leaves are evicted least recently used first. A prefill chunk inserts its full
  pages (SGLang's ``cache_unfinished_req``); a finished request inserts prompt + output. ``cached_tokens`` is
  the prompt found cached at first admission (at most the prompt minus one token), as the local engine reports.
* **Pins** (``keep_warm_s``): a finished request's pages stay unevictable until its continuation reuses them or
  the TTL passes in virtual time. Admission never evicts pins; a decode step that would otherwise retract, or a
  request that cannot start on an idle engine, releases the pins nearest their deadline first.
* **Scheduling**: waiting requests by priority (higher first), then arrival; at most ``max_running`` run.
  Admission stops at the first request that does not fit: its uncached prompt + a decode reservation (the full
  remaining ``max_new_tokens`` for ``ignore_eos``, else SGLang's decaying ``new_token_ratio``, 0.7 → 0.098)
  on top of what running requests reserve. ``defer_shared_prefill``: a request whose first uncached page a
  prefilling request is computing waits until that prefill is done, so a GRPO group computes its prompt once
  (the embedded engine's rule).
* **An iteration**: the decode batch (one token per running request) plus up to ``prefill_chunk`` prompt
  tokens of admitted requests (a mixed batch); a request whose prefill completes samples its first token. With
  ``mixed_prefill=False`` (SGLang's default, no ``--enable-mixed-chunk``) an iteration with prefill work does only
  that, and the running requests wait for the next one ("run prefill first if possible").
* **Retraction**: when the decode step needs more pages than are free or evictable, running requests are
  retracted lowest priority first, then fewest output tokens, then longest prompt (SGLang's order), keeping at
  least one; a retracted request frees its private pages (not inserted, as SGLang), re-queues, and re-prefills
  prompt + output so far. Its streamed tokens stay streamed and are not sent again.

Invariants: output tokens, logprobs and versions share one length; a token carries the version current when
its iteration was planned; every token is sent exactly once (held tokens ride with a later chunk); all state
changes happen in the loop task, API commands between iterations.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectSendStream

from rollopt.config import SimEngineConfig
from rollopt.engines.base import (
    EngineFailure, EngineInfo, FinishReason, GenerateChunk, GenerateRequest, GenerateResult, PauseMode,
    next_version,
)
from rollopt.engines.command_loop import Command, CommandLoopEngine
from rollopt.engines.sim_cost import CostModel, IterationFeatures, ModelShape, resolve
from rollopt.engines.virtual_clock import on_grid
from rollopt.errors import BadRequestError, ConfigError

Script = Callable[[GenerateRequest], list[int]]

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's cap on the decode tokens one request reserves at admission
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, RATIO_DECAY_STEPS, RETRACT_DECODE_STEPS = 0.7, 0.7 * 0.14, 600, 20


class _State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(eq=False)
class _Block:
    hash: int
    tokens: tuple[int, ...]
    parent: "_Block | None"
    id: int
    lock: int = 0  # running requests holding it
    pins: int = 0  # live pins covering it
    children: int = 0
    last_used: int = 0
    alive: bool = True
    orphan: bool = False  # dropped from the index by a flush while locked: freed when unlocked
    pin_records: list["_Pin"] = field(default_factory=list)  # pins whose deepest page this is


@dataclass(eq=False)
class _Pin:
    chain: list[_Block]
    until: float
    released: bool = False


@dataclass(eq=False)
class _Req:
    """A request's state. Its output is ``plan[:n]`` (the script decides every token in advance, so sampling a
    token is counting); its versions are kept as runs ``(first position, version)``."""

    req: GenerateRequest
    send: MemoryObjectSendStream[GenerateChunk]
    order: int  # FCFS position, given when it is queued (-1 before)
    plan: list[int]
    limit: int  # tokens it emits at most: max_new_tokens, the script's length, or up to its first stop token
    end: tuple[FinishReason, int | None]  # how it finishes on reaching ``limit``
    state: _State = _State.WAITING
    chain: list[_Block] = field(default_factory=list)
    private: int = 0  # pages held outside the prefix cache
    filled: int = 0  # positions whose KV is computed
    epoch: int = 0  # the cache epoch its KV belongs to
    cached_tokens: int = -1  # -1: not admitted yet
    n: int = 0  # tokens sampled
    vruns: list[tuple[int, int]] = field(default_factory=list)
    vlast: int = -1
    sent: int = 0
    finish: tuple[FinishReason, int | str | None] | None = None

    @property
    def out(self) -> list[int]:
        return self.plan[: self.n]

    def sequence(self) -> tuple[int, ...]:
        """Prompt + output so far."""
        return (*self.req.input_ids, *self.plan[: self.n]) if self.n else self.req.input_ids

    def versions(self, a: int, b: int) -> list[int]:
        out: list[int] = []
        runs = self.vruns
        for i, (start, version) in enumerate(runs):
            stop = runs[i + 1][0] if i + 1 < len(runs) else self.n
            lo, hi = max(start, a), min(stop, b)
            if lo < hi:
                out += [version] * (hi - lo)
        return out


@dataclass
class SimStats:
    """Counters since start; times are virtual seconds."""

    iterations: int = 0
    busy_s: float = 0.0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    sampled_tokens: int = 0
    decode_tokens: int = 0  # sampled by decode steps (a request's first token comes from its prefill)
    retractions: int = 0
    evicted_blocks: int = 0
    pins: int = 0
    pin_hits: int = 0
    pins_expired: int = 0
    pins_released_early: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    peak_used_blocks: int = 0


def sampled_text(vocab_size: int, eos_token_ids: Sequence[int] = ()) -> Script:
    """The default script: ``max_new_tokens`` ids drawn uniformly from the vocabulary less the EOS ids, seeded by
    the prompt and, for a sampled request, its seed (else its rid), so what the engine's mechanics see is what a
    sampled model gives them: text that differs per request, so trajectories' histories diverge after the prompt
    they share. The same prompt gives the same tokens to a greedy request, and to a sampled one with the same seed.

    (With one filler id for every token, every trajectory wrote the same text and their histories shared KV that
    no real engine shares: on ``tool-heavy`` against the SGLang CPU server with 8,192 tokens of KV, the sim served
    97% of prompt tokens from its cache and SGLang 57%, and the sim ran 40% faster.)"""
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.asarray(eos_token_ids, dtype=np.int64))

    def script(request: GenerateRequest) -> list[int]:
        s = request.sampling
        digest = hashlib.blake2b(np.asarray(request.input_ids, dtype=np.int64).tobytes(), digest_size=16)
        if s.temperature > 0:
            digest.update((str(s.seed) if s.seed is not None else "rid:" + request.rid).encode())
        rng = np.random.default_rng(int.from_bytes(digest.digest(), "little"))
        return allowed[rng.integers(0, len(allowed), s.max_new_tokens)].tolist()

    return script


class SimEngine(CommandLoopEngine):
    """See the module docstring. ``record=True`` keeps ``(start, features, seconds)`` of every iteration in
    :attr:`iterations`."""

    def __init__(self, cost: CostModel, kv_tokens: int, config: SimEngineConfig | None = None, *,
                 script: Script | None = None, vocab_size: int = 1 << 17, eos_token_ids: Sequence[int] = (),
                 tokenizer: Any = None, model_name: str = "sim", record: bool = False) -> None:
        self.config = cfg = config or SimEngineConfig(kv_tokens=kv_tokens, max_context=min(32768, kv_tokens // 16 * 16))
        kv_tokens = kv_tokens // cfg.block_size * cfg.block_size  # whole pages
        if kv_tokens < cfg.max_context:
            raise ConfigError(f"the KV pool ({kv_tokens} tokens) cannot hold one max_context={cfg.max_context} "
                              "request; lower max_context or raise kv_tokens")
        self.cost, self.kv_tokens, self.vocab_size = cost, kv_tokens, vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer, self.model_name = tokenizer, model_name
        filler = cfg.filler_token
        if filler is not None and not 0 <= filler < vocab_size:
            raise ConfigError(f"engine.filler_token={filler} is outside the vocabulary [0, {vocab_size})")
        self.script = script or (sampled_text(vocab_size, self.eos_token_ids) if filler is None else
                                 (lambda request: [filler] * request.sampling.max_new_tokens))
        self.version = 0
        self.stats = SimStats()
        self.record = record
        self.iterations: list[tuple[float, IterationFeatures, float]] = []
        self._B = cfg.block_size
        self._capacity = kv_tokens // cfg.block_size
        self._used = 0
        self._index: dict[int, _Block] = {}
        self._lru: list[tuple[int, int, _Block]] = []  # (last_used, id, block): lazy, validated when popped
        self._pins: list[tuple[float, int, _Pin]] = []
        self._n_evictable = 0  # indexed pages neither locked nor pinned
        self._n_pinned = 0  # indexed pages pinned, not locked
        self._ids = itertools.count()
        self._tick = 0
        self._epoch = 0
        self._waiting: list[tuple[int, int, _Req]] = []  # heap of (-priority, order, request)
        self._n_waiting = 0
        self._running: list[_Req] = []
        self._bound = 0  # Σ prompt + max_new_tokens of running requests: bounds what they can still reserve
        self._arrivals: list[_Req] = []
        self._live: dict[str, _Req] = {}
        self._order = itertools.count()
        self._commands: list[Command] = []
        self._paused: PauseMode | None = None
        self._ratio = INIT_NEW_TOKEN_RATIO
        self._wakeup = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._failure: BaseException | None = None

    @classmethod
    def from_config(cls, config: SimEngineConfig, shape: ModelShape | None, **kwargs: Any) -> "SimEngine":
        """The engine a configuration describes for ``shape`` (the cost model and the KV pool follow from both)."""
        cost, kv_tokens = resolve(config, shape)
        return cls(cost, kv_tokens, config, **kwargs)

    def describe(self) -> str:
        """One line for outputs: the cost model (a roofline says it is a projection) and the sizes."""
        c = self.config
        return (f"sim engine, {self.cost.name}: KV {self.kv_tokens} tokens in pages of {c.block_size}, "
                f"max_running {c.max_running}, prefill_chunk {c.prefill_chunk}"
                f"{'' if c.mixed_prefill else ' (prefill runs alone)'}, virtual clock")

    def check_invariants(self) -> None:
        """Recount the KV pool's books from scratch and compare (for tests; O(pages))."""
        active = [r for r in self._running if r.state is _State.PREFILL or r.state is _State.DECODE]
        locks: dict[int, int] = {}
        orphans = set()
        for r in active:
            held = len(r.chain) * self._B + r.private * self._B
            assert r.filled <= held < r.filled + self._B, r.req.rid
            for b in r.chain:
                locks[b.id] = locks.get(b.id, 0) + 1
                if b.orphan:
                    orphans.add(b.id)
        pins: dict[int, int] = {}
        for _, _, pin in self._pins:
            if not pin.released:
                for b in pin.chain:
                    pins[b.id] = pins.get(b.id, 0) + 1
        children: dict[int, int] = {}
        for b in self._index.values():
            if b.parent is not None:
                children[b.parent.id] = children.get(b.parent.id, 0) + 1
        for b in self._index.values():
            assert b.alive and not b.orphan and b.lock == locks.get(b.id, 0) and b.pins == pins.get(b.id, 0)
            assert b.children == children.get(b.id, 0)
        assert self._used == sum(r.private for r in active) + len(self._index) + len(orphans) <= self._capacity
        assert self._n_evictable == sum(1 for b in self._index.values() if b.lock == 0 and b.pins == 0)
        assert self._n_pinned == sum(1 for b in self._index.values() if b.lock == 0 and b.pins > 0)
        assert self._bound == sum(len(r.req.input_ids) + r.req.sampling.max_new_tokens for r in active)
        assert self._n_waiting == sum(1 for *_, r in self._waiting if r.state is _State.WAITING)

    # ------------------------------------------------------------------------------------------ lifecycle
    # ------------------------------------------------------------------------------------------ API
    def _check_request(self, request: GenerateRequest) -> None:
        request.sampling.validate()
        ids, cfg = request.input_ids, self.config
        if not ids:
            raise BadRequestError(f"request {request.rid}: empty prompt")
        if len(ids) + request.sampling.max_new_tokens > cfg.max_context:
            raise BadRequestError(
                f"request {request.rid}: prompt of {len(ids)} tokens + max_new_tokens="
                f"{request.sampling.max_new_tokens} exceeds max_context={cfg.max_context}; shorten the prompt, "
                "lower max_new_tokens or raise SimEngineConfig.max_context")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise BadRequestError(f"request {request.rid}: token ids outside the vocabulary [0, {self.vocab_size})")
        self._check_common(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self._require_running()
        self._check_request(request)
        sp = request.sampling
        plan = list(self.script(request)[: sp.max_new_tokens])
        end: tuple[FinishReason, int | None] = (
            FinishReason.LENGTH if len(plan) == sp.max_new_tokens else FinishReason.STOP, None)
        limit = len(plan)
        stops = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(self.eos_token_ids))
        if stops and not stops.isdisjoint(plan):
            limit = next(i for i, t in enumerate(plan) if t in stops) + 1
            end = (FinishReason.STOP, plan[limit - 1])
        send, receive = anyio.create_memory_object_stream[GenerateChunk](math.inf)
        r = _Req(request, send, -1, plan, limit, end)
        self._live[request.rid] = r
        self._arrivals.append(r)
        self._wakeup.set()
        finished = False
        try:
            async with receive:
                async for chunk in receive:
                    finished = chunk.result is not None
                    yield chunk
                    if finished:
                        return
            if self._failure is not None:
                raise EngineFailure(f"request {request.rid}: engine loop failed: {self._failure!r}",
                                    partial=self._result(r, FinishReason.ABORT))
        finally:
            if not finished and request.rid in self._live:
                self._commands.append(Command("abort", request.rid))  # the caller went away: free its KV
                self._wakeup.set()

    async def abort(self, rid: str) -> None:
        await self._command("abort", rid)

    async def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        """Nothing is loaded (the sim has no weights); bumps the version and invalidates the prefix cache."""
        return await self._command("update_weights", next_version(self.version, version))

    async def info(self) -> EngineInfo:
        return EngineInfo(self.model_name, self.vocab_size, self.config.max_context, self.version, self.eos_token_ids,
                          kv_tokens=self.kv_tokens, running_kv_tokens=self.kv_tokens,
                          max_running=self.config.max_running)

    # ------------------------------------------------------------------------------------------ loop
    def _has_work(self) -> bool:
        return self._paused is None and bool(self._n_waiting or self._arrivals or self._running)

    async def _loop(self) -> None:
        try:
            while True:
                # the host works in zero virtual time: an iteration starts once every other task is blocked, so it
                # sees every request submitted at this instant whatever order the event loop ran their tasks in
                await anyio.wait_all_tasks_blocked()
                self._apply_commands()
                if not self._has_work():
                    self._ratio = INIT_NEW_TOKEN_RATIO  # SGLang resets the ratio when idle
                    self._wakeup = anyio.Event()
                    if not (self._commands or self._arrivals):
                        await self._wakeup.wait()
                    continue
                now = anyio.current_time()
                features, sent = self._iteration(now)
                if features is None:  # nothing ran: prefills blocked each other's pages, or only stale entries
                    if not self._retract_for_progress():
                        self._wakeup = anyio.Event()
                        await self._wakeup.wait()
                    continue
                seconds = on_grid(self.cost.seconds(features))
                self.stats.iterations += 1
                self.stats.busy_s += seconds
                if self.record:
                    self.iterations.append((now, features, seconds))
                await anyio.sleep(seconds)
                self._emit(sent)
        except Exception as exc:  # a bug in the loop: every request gets its tokens so far, then a failure
            self._failure = exc
            for r in list(self._live.values()):
                r.send.close()
            for command in self._commands:
                if command.done is not None:
                    command.done.set()

    def _apply_commands(self) -> None:
        for r in sorted(self._arrivals, key=lambda r: r.req.rid):  # one instant's arrivals queue in rid order
            r.order = next(self._order)
            self._push_waiting(r)
        self._arrivals = []
        commands, self._commands = self._commands, []
        for command in commands:
            try:
                command.value = self._apply(command.name, command.arg)
            except Exception as exc:
                command.error = exc
            if command.done is not None:
                command.done.set()

    def _apply(self, name: str, arg: Any) -> Any:
        if name == "abort":
            r = self._live.get(arg)
            if r is not None:
                self._finish(r, FinishReason.ABORT, None)
        elif name == "pause":
            self._paused = arg
            if arg == "abort":
                for r in list(self._live.values()):
                    self._finish(r, FinishReason.ABORT, None)
            elif arg == "retract":
                self._retract_running()
        elif name == "resume":
            self._paused = None
        elif name == "update_weights":
            self.version = arg
            self._retract_running()  # as SGLang's update under pause_generation(mode="retract") (base: update_weights)
            self._clear_cache()
            return self.version
        elif name == "flush_cache":
            self._clear_cache()
        else:
            raise ValueError(f"unknown command {name}")
        return None

    # ------------------------------------------------------------------------------------------ iteration
    def _iteration(self, now: float) -> tuple[IterationFeatures | None, list[_Req]]:
        """Plan one iteration and apply its effects on the state (tokens are sent after its virtual time)."""
        self._running = [r for r in self._running if r.state is _State.PREFILL or r.state is _State.DECODE]
        self._expire_pins(now)
        if self.config.mixed_prefill:
            rows = self._decode_rows()
            self._admit()
        else:  # SGLang's default: a prefill batch runs alone whenever there is one, the decode batch otherwise
            self._admit()
            rows = [] if any(r.state is _State.PREFILL for r in self._running) else self._decode_rows()
        budget, f_prefill, f_seqs, f_attn, f_ctx, logit_rows = self.config.prefill_chunk, 0, 0, 0, 0, 0
        sent: list[_Req] = []
        for r in self._running:
            if budget <= 0:
                break
            if r.state is not _State.PREFILL:
                continue
            target = len(r.req.input_ids) + r.n
            n = min(budget, target - r.filled)
            if not self._grow(r, r.filled + n, force=not rows):
                break
            p = r.filled
            f_prefill, f_seqs, f_attn, f_ctx = f_prefill + n, f_seqs + 1, f_attn + n * p + n * (n + 1) // 2, f_ctx + p
            r.filled += n
            budget -= n
            self._insert(r)
            if r.filled == target:
                r.state = _State.DECODE
                if r.n < r.limit:
                    logit_rows += 1
                    self.stats.sampled_tokens += 1
                    self._sample(r, sent)
                else:  # max_new_tokens == 0 (prefill only) or an empty script
                    r.finish = r.end
                    sent.append(r)
        if not rows and not f_prefill and not sent and not self.config.mixed_prefill:
            rows = self._decode_rows()  # no page for any prefill now: decode (and free pages) instead of idling
        self.stats.prefill_tokens += f_prefill
        kv_read, version = 0, self.version
        for r in rows:  # the hot loop: one decode step of every running request, inlined ``_sample``
            filled = r.filled = r.filled + 1
            kv_read += filled
            if r.req.sampling.stop:
                self._sample(r, sent)
                continue
            n = r.n = r.n + 1
            if r.vlast != version:
                r.vruns.append((n - 1, version))
                r.vlast = version
            if n >= r.limit:
                r.finish = r.end
                sent.append(r)
            else:
                watched = r.req.stream_tokens
                if watched is None or r.sent == 0 or r.plan[n - 1] in watched:
                    sent.append(r)
        self.stats.decode_tokens += len(rows)
        self.stats.sampled_tokens += len(rows)
        if not rows and not f_prefill:
            return None, sent  # nothing was sampled either: a sample needs a prefill or a decode row
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, self._used)
        return IterationFeatures(f_prefill, f_seqs, f_attn, f_ctx, len(rows), kv_read, logit_rows + len(rows)), sent

    def _sample(self, r: _Req, sent: list[_Req]) -> None:
        """Take ``r``'s next scripted token; mark it finished or to be sent."""
        tok = r.plan[r.n]
        r.n += 1
        if r.vlast != self.version:
            r.vruns.append((r.n - 1, self.version))
            r.vlast = self.version
        if r.n >= r.limit:
            r.finish = r.end
        elif r.req.sampling.stop:
            tail = self.tokenizer.decode(r.plan[max(r.n - 64, 0): r.n])
            hit = next((s for s in r.req.sampling.stop if s in tail), None)
            if hit is not None:
                r.finish = (FinishReason.STOP, hit)
        watched = r.req.stream_tokens
        if r.finish or watched is None or r.sent == 0 or tok in watched:  # base.may_hold_back, one token at a time
            sent.append(r)

    def _decode_rows(self) -> list[_Req]:
        """The running requests that decode this iteration, each with the page its next token needs; retracts
        (SGLang's ``retract_decode`` order) while the pool cannot give every row its page."""
        rows = [r for r in self._running if r.state is _State.DECODE]
        B = self._B
        needy = [r for r in rows if r.filled + 1 - len(r.chain) * B > r.private * B]
        if len(needy) > self._capacity - self._used + self._n_evictable:
            # first release pins (nearest deadline first), then retract
            while len(needy) > self._capacity - self._used + self._n_evictable and self._release_soonest_pin():
                pass
            victims = sorted(self._running, key=lambda r: (r.req.priority, r.n, -len(r.req.input_ids)),
                             reverse=True)
            retracted = False
            while len(needy) > self._capacity - self._used + self._n_evictable and len(victims) > 1:
                victim = victims.pop()
                self._retract(victim)
                retracted = True
                if victim in needy:
                    needy.remove(victim)
            if retracted:
                self._running = [r for r in self._running if r.state is not _State.WAITING]
                rows = [r for r in rows if r.state is _State.DECODE]
                decoded = sum(r.n for r in rows)
                self._ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(rows))
                                  / (sum(r.req.sampling.max_new_tokens for r in rows) + 1))
        elif rows:
            self._ratio = max(self._ratio - (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / RATIO_DECAY_STEPS,
                              MIN_NEW_TOKEN_RATIO)
        for r in needy:
            if not self._reserve(1, force=True):
                raise AssertionError("decode pages were counted as available but could not be freed")
            r.private += 1
        return rows

    def _retract_for_progress(self) -> bool:
        """Nothing ran (prefills blocked by each other's pages): retract the last request in retraction order."""
        if len(self._running) < 2:
            return False
        victim = min(self._running, key=lambda r: (r.req.priority, r.n, -len(r.req.input_ids)))
        self._retract(victim)
        self._running.remove(victim)
        return True

    def _reserve_tokens(self, r: _Req) -> float:
        """Tokens ``r`` may still need beyond what it holds: its unprefilled prompt and its decode reservation."""
        remaining = min(r.req.sampling.max_new_tokens - r.n, CLIP_MAX_NEW_TOKENS)
        ratio = 1.0 if r.req.sampling.ignore_eos else self._ratio
        return len(r.req.input_ids) + r.n - r.filled + remaining * ratio

    def _admit(self) -> None:
        cfg, B = self.config, self._B
        if len(self._running) >= cfg.max_running or not self._n_waiting:
            return
        reserved = None  # what running requests reserve: summed only when the cheap bound is not enough
        prefilling: dict[tuple[int, ...], list[_Req]] = {}  # first page → the requests prefilling after it
        for s in self._running:
            if s.state is _State.PREFILL:
                prefilling.setdefault(s.req.input_ids[:B], []).append(s)
        deferred = []
        while self._waiting and len(self._running) < cfg.max_running:
            r = self._waiting[0][2]
            if r.state is not _State.WAITING:
                heapq.heappop(self._waiting)
                continue
            head = r.req.input_ids[:B]
            seq_len = len(r.req.input_ids) + r.n
            chain = self._lookup(r, seq_len - 1)
            if cfg.defer_shared_prefill and head in prefilling and self._computed_by(r, len(chain), prefilling[head]):
                deferred.append(heapq.heappop(self._waiting))
                continue
            taken = sum(1 for b in chain if b.lock == 0 and b.pins == 0)
            need = self._reserve_tokens(r) - len(chain) * B
            room = (self._capacity - self._used + self._n_evictable - taken) * B
            if need > room - self._bound:  # the bound: every running request's prompt + max_new_tokens
                if reserved is None:
                    reserved = sum(map(self._reserve_tokens, self._running))
                if need > room - reserved:
                    if self._running or not self._release_soonest_pin():
                        break
                    continue  # an idle engine releases pins until the head of the queue fits
            heapq.heappop(self._waiting)
            self._n_waiting -= 1
            if reserved is not None:
                reserved += need  # its reservation once admitted (its cached prefix is held, not reserved)
            self._bound += len(r.req.input_ids) + r.req.sampling.max_new_tokens
            self._tick += 1
            for b in chain:
                b.last_used = self._tick
                self._ref(b, dlock=1)
                if b.pin_records:  # the continuation took the pinned history: the pin has done its job
                    for pin in b.pin_records:
                        self.stats.pin_hits += not pin.released
                        self._release(pin)
                    b.pin_records = []
            r.chain, r.private, r.filled, r.epoch = chain, 0, len(chain) * B, self._epoch
            if r.cached_tokens < 0:  # a retracted request's re-prefill hits are not reported
                r.cached_tokens = len(chain) * B
                self.stats.cached_tokens += r.cached_tokens
            r.state = _State.PREFILL
            self._running.append(r)
            prefilling.setdefault(head, []).append(r)
        for entry in deferred:
            heapq.heappush(self._waiting, entry)

    # ------------------------------------------------------------------------------------------ finishing
    def _emit(self, sent: list[_Req]) -> None:
        """After the iteration's virtual time: send the chunks and results it produced."""
        for r in sent:
            if r.state is _State.DONE:
                continue
            if r.finish is not None:
                self._finish(r, *r.finish)
            elif r.n > r.sent:
                self._send(r)

    def _send(self, r: _Req, result: GenerateResult | None = None) -> None:
        a, b = r.sent, r.n
        chunk = GenerateChunk(r.req.rid, r.plan[a:b], [self.config.logprob] * (b - a), r.versions(a, b), result)
        r.sent = b
        try:
            r.send.send_nowait(chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the consumer went away; its abort command is queued

    def _result(self, r: _Req, reason: FinishReason, matched: int | str | None = None) -> GenerateResult:
        return GenerateResult(r.req.rid, r.out, [self.config.logprob] * r.n, r.versions(0, r.n), reason,
                              prompt_tokens=len(r.req.input_ids), cached_tokens=max(r.cached_tokens, 0),
                              matched_stop=matched)

    def _finish(self, r: _Req, reason: FinishReason, matched: int | str | None) -> None:
        if r.state is _State.PREFILL or r.state is _State.DECODE:
            pinned = self._insert(r)
            if pinned and r.req.keep_warm_s > 0:
                self._pin(pinned, anyio.current_time() + on_grid(r.req.keep_warm_s))
            self._free(r)
        elif r.state is _State.WAITING:
            self._n_waiting -= 1
        r.state = _State.DONE
        self._send(r, self._result(r, reason, matched))
        r.send.close()
        self._live.pop(r.req.rid, None)
        self.stats.requests_finished += 1
        self.stats.requests_aborted += reason is FinishReason.ABORT

    def _retract_running(self) -> None:
        """Retract every running request; one paused in place loses its KV, so the pause becomes a retract."""
        for r in self._running:
            if r.state is _State.PREFILL or r.state is _State.DECODE:
                self._retract(r)
        self._running = []
        if self._paused == "in_place":
            self._paused = "retract"

    def _retract(self, r: _Req) -> None:
        """Free ``r``'s private pages (not cached, as SGLang) and unlock its prefix; re-queue it."""
        self._free(r)
        r.state, r.filled = _State.WAITING, 0
        r.finish = None
        self._push_waiting(r)
        self.stats.retractions += 1

    def _push_waiting(self, r: _Req) -> None:
        heapq.heappush(self._waiting, (-r.req.priority, r.order, r))
        self._n_waiting += 1

    # ------------------------------------------------------------------------------------------ KV pool
    def _free(self, r: _Req) -> None:
        """``r`` stops running: its private pages are freed, its prefix unlocked."""
        self._bound -= len(r.req.input_ids) + r.req.sampling.max_new_tokens
        self._used -= r.private
        r.private = 0
        for b in r.chain:
            self._ref(b, dlock=-1)
        r.chain = []

    def _grow(self, r: _Req, tokens: int, force: bool) -> bool:
        """Give ``r`` the private pages to hold ``tokens`` positions."""
        need = -(-(tokens - len(r.chain) * self._B) // self._B) - r.private
        if need > 0:
            if not self._reserve(need, force):
                return False
            r.private += need
        return True

    def _reserve(self, n: int, force: bool) -> bool:
        """Make ``n`` pages free (evicting; with ``force``, releasing pins too) and take them."""
        while self._capacity - self._used < n:
            if not self._evict_one() and not (force and self._release_soonest_pin()):
                return False
        self._used += n
        return True

    def _ref(self, b: _Block, dlock: int = 0, dpin: int = 0) -> None:
        """Change a page's lock or pin count, keeping the evictable/pinned counts and the LRU heap current."""
        if b.orphan:
            b.lock += dlock
            if b.lock == 0:
                b.orphan, b.alive = False, False
                self._used -= 1
            return
        was_free, was_pinned = b.lock == 0 and b.pins == 0, b.lock == 0 and b.pins > 0
        b.lock += dlock
        b.pins += dpin
        is_free, is_pinned = b.lock == 0 and b.pins == 0, b.lock == 0 and b.pins > 0
        self._n_evictable += is_free - was_free
        self._n_pinned += is_pinned - was_pinned
        if is_free and not was_free and b.children == 0:
            heapq.heappush(self._lru, (b.last_used, b.id, b))

    def _evict_one(self) -> bool:
        while self._lru:
            last_used, _, b = heapq.heappop(self._lru)
            if not b.alive or b.orphan or b.lock or b.pins or b.children:
                continue  # stale: it is pushed again when it becomes an evictable leaf
            if last_used != b.last_used:
                heapq.heappush(self._lru, (b.last_used, b.id, b))
                continue
            del self._index[b.hash]
            b.alive = False
            self._used -= 1
            self._n_evictable -= 1
            self.stats.evicted_blocks += 1
            parent = b.parent
            if parent is not None:
                parent.children -= 1
                if parent.children == 0 and parent.lock == 0 and parent.pins == 0:
                    heapq.heappush(self._lru, (parent.last_used, parent.id, parent))
            return True
        return False

    def _computed_by(self, r: _Req, cached_pages: int, sharers: Sequence[_Req]) -> bool:
        """True if one of ``sharers`` (prefilling) is computing ``r``'s first page past its cached ones: admitted
        after that prefill, ``r`` reuses the page instead of computing it again (a GRPO group's prompt)."""
        B = self._B
        start = cached_pages * B
        page = r.req.input_ids[start:start + B]
        return len(page) == B and any(s.req.input_ids[start:start + B] == page for s in sharers)

    def _lookup(self, r: _Req, max_tokens: int) -> list[_Block]:
        """The cached pages of the longest page prefix of ``r``'s sequence within ``max_tokens``."""
        chain: list[_Block] = []
        h, parent, B = 0, None, self._B
        seq = r.req.input_ids if max_tokens <= len(r.req.input_ids) else r.sequence()
        for j in range(max_tokens // B):
            toks = seq[j * B:(j + 1) * B]
            h = hash((h, toks))
            b = self._index.get(h)
            if b is None or b.parent is not parent or b.tokens != toks:
                break
            chain.append(b)
            parent = b
        return chain

    def _insert(self, r: _Req) -> list[_Block]:
        """Move ``r``'s full private pages into the prefix cache (deduplicating pages cached meanwhile); returns
        its chain. A request whose KV predates a cache flush inserts nothing."""
        if r.epoch != self._epoch:
            return []
        B = self._B
        full = r.filled // B
        chain = r.chain
        if len(chain) >= full:
            return chain
        parent = chain[-1] if chain else None
        h = parent.hash if parent is not None else 0
        self._tick += 1
        seq = r.req.input_ids if r.filled <= len(r.req.input_ids) else r.sequence()
        for j in range(len(chain), full):
            toks = seq[j * B:(j + 1) * B]
            h = hash((h, toks))
            b = self._index.get(h)
            if b is not None and (b.parent is not parent or b.tokens != toks):
                break  # a hash collision with another chain: stop caching this sequence here
            if b is None:
                b = _Block(h, toks, parent, next(self._ids), last_used=self._tick)
                self._index[h] = b
                self._n_evictable += 1  # counted unlocked, then locked by r below
                if parent is not None:
                    parent.children += 1
                r.private -= 1  # the page moves from r to the cache
            else:
                self._used -= 1  # the same page was cached meanwhile: r's copy is freed
                r.private -= 1
            b.last_used = self._tick
            self._ref(b, dlock=1)
            chain.append(b)
            parent = b
        return chain

    def _pin(self, chain: list[_Block], until: float) -> None:
        pin = _Pin(list(chain), until)
        for b in chain:
            self._ref(b, dpin=1)
        chain[-1].pin_records.append(pin)
        heapq.heappush(self._pins, (until, id(pin), pin))
        self.stats.pins += 1

    def _release(self, pin: _Pin) -> None:
        if pin.released:
            return
        pin.released = True
        for b in pin.chain:
            if b.alive and not b.orphan:
                self._ref(b, dpin=-1)

    def _expire_pins(self, now: float) -> None:
        while self._pins and self._pins[0][0] <= now:
            pin = heapq.heappop(self._pins)[2]
            self.stats.pins_expired += not pin.released
            self._release(pin)

    def _release_soonest_pin(self) -> bool:
        while self._pins:
            pin = heapq.heappop(self._pins)[2]
            if not pin.released:
                self._release(pin)
                self.stats.pins_released_early += 1
                return True
        return False

    def _clear_cache(self) -> None:
        """Drop every cached page (after a weight update its KV is stale): unlocked pages are freed, pages that
        running requests hold are freed when they let go, and pins end."""
        for b in self._index.values():
            b.pins = 0
            b.pin_records = []
            if b.lock:
                b.orphan = True
            else:
                b.alive = False
                self._used -= 1
        for _, _, pin in self._pins:
            pin.released = True
        self._index.clear()
        self._lru.clear()
        self._pins.clear()
        self._n_evictable = self._n_pinned = 0
        self._epoch += 1
