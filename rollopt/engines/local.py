"""The embedded engine: in-process, torch, continuous batching over a slot KV cache, with a prefix cache.

How it runs: ``async with LocalEngine(...) as engine`` starts one engine-loop task. Each *tick* (run in a
worker thread, so the event loop stays free for tools and other I/O) does, in order:

1. prefill: up to ``prefill_chunk`` prompt tokens of admitted requests, one request per forward pass (a long
   prompt takes several ticks); the prefix cache supplies the KV of the longest cached block prefix first. A
   waiting request whose first block matches a request still prefilling is admitted after that prefill, so
   requests of one GRPO group arriving together compute their shared prompt once;
2. decode: one batched step for every request that has finished its prefill.

Requests that arrive while others decode join at the next tick. All state changes happen either inside a
tick or in the loop between ticks (commands such as abort, pause and weight updates are queued and applied
there), so nothing races with the forward pass.

Invariants:

* each output token is tagged with the weight version that sampled it; an update between two ticks takes
  effect for the next token of every request in flight, and clears the prefix cache;
* greedy results do not depend on which other requests share the batch: prefill runs per request, decode
  rows are independent, and sampling is per row (``tests/test_local_engine.py`` checks alone vs. among 31);
* an aborted request's result holds every token sampled so far;
* the KV memory is fixed at start (``max_running`` slots × ``max_context`` positions + the prefix cache) and
  checked against ``kv_budget_mb``; requests beyond the free slots wait in a queue.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping

import anyio
import torch
from anyio.streams.memory import MemoryObjectSendStream

from rollopt.engines.base import (
    EngineFailure,
    EngineInfo,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    may_hold_back,
    next_version,
)
from rollopt.config import LocalEngineConfig
from rollopt.engines.command_loop import Command, CommandLoopEngine
from rollopt.engines.prefix_cache import PrefixCache
from rollopt.engines.sampling import sample_token
from rollopt.errors import BadRequestError, ConfigError
from rollopt.modeling.llama import LlamaModel, SlotKV


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[name]


class _State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class _Request:
    req: GenerateRequest
    send: MemoryObjectSendStream[GenerateChunk]
    generator: torch.Generator
    order: int
    state: _State = _State.WAITING
    slot: int = -1
    filled: int = 0  # positions of this request's sequence whose KV is in its slot
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    sent: int = 0  # output tokens already streamed
    abort_requested: bool = False

    @property
    def sequence(self) -> list[int]:
        return [*self.req.input_ids, *self.output_ids]


@dataclass
class EngineStats:
    """Counters since start. ``prefill_tokens`` counts computed prompt tokens (cache hits excluded);
    ``sampled_tokens`` counts every sampled token, ``decode_tokens`` those sampled by decode steps (a
    request's first token comes from its prefill);
    ``prefill_s`` / ``decode_s`` are the time spent in each phase of the ticks."""

    ticks: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    sampled_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    busy_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    requests_finished: int = 0
    requests_aborted: int = 0
    retractions: int = 0


class LocalEngine(CommandLoopEngine):
    """The embedded engine for HF Llama/Qwen2 causal LMs; see the module docstring for how it runs."""

    def __init__(self, config, state_dict: Mapping[str, torch.Tensor], engine_config: LocalEngineConfig | None = None,
                 tokenizer: Any = None, model_name: str = "local") -> None:
        self.engine_config = cfg = engine_config or LocalEngineConfig()
        dtype = torch_dtype(cfg.dtype)
        self.model = LlamaModel(config, state_dict, dtype, batch_invariant=cfg.batch_invariant,
                                invariant_prefill=cfg.invariant_prefill, device=cfg.device)
        cfg.validate(self.model.shape.kv_bytes_per_token(dtype))
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.kv = SlotKV(self.model.shape, cfg.max_running, cfg.max_context, dtype, cfg.device)
        self.prefix_cache = PrefixCache(cfg.block_size, cfg.prefix_cache_tokens)
        eos = config.eos_token_id
        self.eos_token_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        self.version = 0
        self.stats = EngineStats()
        self._slots: list[_Request | None] = [None] * cfg.max_running
        self._waiting: list[_Request] = []  # the tick's queue: touched only by the loop, between or in ticks
        self._arrivals: list[_Request] = []  # new requests, appended by stream() even while a tick runs
        self._live: dict[str, _Request] = {}
        self._order = itertools.count()
        self._commands: list[Command] = []
        self._paused: PauseMode | None = None
        self._wakeup = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._failure: BaseException | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, engine_config: LocalEngineConfig | None = None) -> "LocalEngine":
        """Load an HF model directory (``config.json`` + safetensors) and its tokenizer."""
        from rollopt.modeling.loading import load_hf_dir

        config, state_dict, tokenizer = load_hf_dir(path)
        return cls(config, state_dict, engine_config, tokenizer=tokenizer, model_name=str(path))

    # ------------------------------------------------------------------------------------------ lifecycle
    # ------------------------------------------------------------------------------------------ API
    def _check_request(self, request: GenerateRequest) -> None:
        cfg, vocab = self.engine_config, self.model.shape.vocab_size
        request.sampling.validate()
        n = len(request.input_ids)
        if n == 0:
            raise BadRequestError(f"request {request.rid}: empty prompt")
        if n + request.sampling.max_new_tokens > cfg.max_context:
            raise BadRequestError(
                f"request {request.rid}: prompt of {n} tokens + max_new_tokens={request.sampling.max_new_tokens} "
                f"exceeds max_context={cfg.max_context}; shorten the prompt, lower max_new_tokens or raise "
                "LocalEngineConfig.max_context")
        bad = [t for t in request.input_ids if not (0 <= t < vocab)]
        if bad:
            raise BadRequestError(f"request {request.rid}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        self._check_common(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self._require_running()
        self._check_request(request)
        send, receive = anyio.create_memory_object_stream[GenerateChunk](math.inf)
        order = next(self._order)
        seed = request.sampling.seed if request.sampling.seed is not None else self.engine_config.seed + order
        r = _Request(req=request, send=send, generator=torch.Generator().manual_seed(seed), order=order)
        self._live[request.rid] = r
        self._arrivals.append(r)  # not _waiting: a tick in the worker thread may be sorting it right now
        self._wakeup.set()
        finished = False
        try:
            async with receive:
                async for chunk in receive:
                    if chunk.result is not None:
                        finished = True
                    yield chunk
                    if finished:
                        return
            if self._failure is not None:
                raise EngineFailure(f"request {request.rid}: engine loop failed: {self._failure!r}",
                                    partial=self._result(r, FinishReason.ABORT))
        finally:
            if not finished and request.rid in self._live:
                self._commands.append(Command("abort", request.rid))  # the caller went away: free its slot
                self._wakeup.set()

    async def abort(self, rid: str) -> None:
        """Abort one request (a no-op if it already finished)."""
        await self._command("abort_one", rid)

    async def update_weights(self, weights: Mapping[str, torch.Tensor], *, version: int | None = None) -> int:
        """Load an HF state dict between ticks; returns the new version (see :meth:`Engine.update_weights`).
        Clears the prefix cache. The engine copies the tensors, so the caller may go on mutating its own."""
        return await self._command("update_weights", (weights, next_version(self.version, version)))

    async def info(self) -> EngineInfo:
        return EngineInfo(model=self.model_name, vocab_size=self.model.shape.vocab_size,
                          max_context=self.engine_config.max_context, version=self.version,
                          eos_token_ids=self.eos_token_ids, kv_tokens=self.engine_config.prefix_cache_tokens,
                          max_running=self.engine_config.max_running)

    # ------------------------------------------------------------------------------------------ loop
    def _has_work(self) -> bool:
        if self._paused is not None:
            return False
        return bool(self._waiting or self._arrivals) or any(s is not None for s in self._slots)

    async def _loop(self) -> None:
        try:
            while True:
                self._apply_commands()
                if not self._has_work():
                    self._wakeup = anyio.Event()
                    if self._commands:
                        continue
                    await self._wakeup.wait()
                    continue
                started = time.perf_counter()
                await anyio.to_thread.run_sync(self._tick)
                self.stats.busy_s += time.perf_counter() - started
                self.stats.ticks += 1
                self._flush_streams()
        except Exception as exc:
            # A failure of the forward pass: every request in flight gets its tokens so far and then an
            # EngineFailure (with the partial result) instead of a hang; the loop stops; the host goes on.
            self._failure = exc
            for r in list(self._live.values()):
                self._flush_stream(r)
                r.send.close()
            for command in self._commands:
                if command.done is not None:
                    command.done.set()

    def _apply_commands(self) -> None:
        """Between ticks, in the event loop: admit new arrivals to the queue, then apply queued commands."""
        arrivals, self._arrivals = self._arrivals, []
        self._waiting.extend(arrivals)
        commands, self._commands = self._commands, []
        for command in commands:
            try:
                command.value = self._apply(command.name, command.arg)
            except Exception as exc:  # reported to the caller of the command
                command.error = exc
            if command.done is not None:
                command.done.set()

    def _apply(self, name: str, arg: Any) -> Any:
        if name in ("abort", "abort_one"):
            r = self._live.get(arg)
            if r is not None:
                self._finish(r, FinishReason.ABORT)
        elif name == "pause":
            self._paused = arg
            if arg == "abort":
                for r in list(self._live.values()):
                    self._finish(r, FinishReason.ABORT)
            elif arg == "retract":
                self._retract_running()
        elif name == "resume":
            self._paused = None
        elif name == "update_weights":
            weights, self.version = arg
            self._retract_running()  # KV the old weights computed would mix versions (base: update_weights)
            self.model.load_state_dict(weights)
            self.prefix_cache.clear()
            return self.version
        elif name == "flush_cache":
            self.prefix_cache.clear()
        else:
            raise ValueError(f"unknown command {name}")
        return None

    # ------------------------------------------------------------------------------------------ tick
    def _tick(self) -> None:
        threads = self.engine_config.threads
        if threads is None:
            return self._step()
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)  # restored after the tick: the worker thread may run a trainer next
        try:
            self._step()
        finally:
            torch.set_num_threads(previous)

    def _step(self) -> None:
        self._admit()
        started = time.perf_counter()
        self._prefill()
        middle = time.perf_counter()
        self._decode()
        self.stats.prefill_s += middle - started
        self.stats.decode_s += time.perf_counter() - middle

    def _shares_block_with_prefill(self, r: _Request) -> bool:
        """True if a request still prefilling computes the first block of ``r`` that the prefix cache lacks:
        admitting ``r`` after that prefill lets it reuse the KV instead of computing it again (a GRPO group's
        prompt). A sibling whose shared part is cached already (a later turn) is not held back."""
        bs, seq = self.engine_config.block_size, r.sequence
        head = r.req.input_ids[:bs]
        sharers = [s.sequence for s in self._slots
                   if s is not None and s.state is _State.PREFILL and s.req.input_ids[:bs] == head]
        if not sharers or len(head) < bs:  # the common case, without hashing the sequence
            return False
        start = self.prefix_cache.cached_tokens(seq, len(seq) - 1)
        page = seq[start:start + bs]
        return len(page) == bs and any(other[start:start + bs] == page for other in sharers)

    def _admit(self) -> None:
        self._waiting.sort(key=lambda r: (-r.req.priority, r.order))
        for r in list(self._waiting):
            if None not in self._slots:
                break
            if (self.engine_config.defer_shared_prefill and self.prefix_cache.capacity_blocks
                    and self._shares_block_with_prefill(r)):
                continue
            self._waiting.remove(r)
            r.slot = self._slots.index(None)
            self._slots[r.slot] = r
            r.state = _State.PREFILL
            seq = r.sequence
            n, k, v = self.prefix_cache.lookup(seq, max_tokens=len(seq) - 1)
            if n:
                self.kv.write(r.slot, 0, k, v)
            r.filled = n
            if not r.output_ids:  # a retracted request re-prefills; its first prefill's hits were counted
                r.cached_tokens = n
            self.stats.cached_tokens += n

    def _prefill(self) -> None:
        budget = self.engine_config.prefill_chunk
        for r in sorted((s for s in self._slots if s is not None and s.state is _State.PREFILL), key=lambda r: r.order):
            if budget <= 0:
                break
            seq = r.sequence
            n = min(budget, len(seq) - r.filled)
            logits = self.model.prefill(self.kv, r.slot, torch.tensor(seq[r.filled:r.filled + n]), r.filled).cpu()
            r.filled += n
            budget -= n
            self.stats.prefill_tokens += n
            if r.filled == len(seq):
                self.prefix_cache.insert(seq, r.filled, lambda a, b, s=r.slot: self.kv.read(s, a, b))
                r.state = _State.DECODE
                if r.req.sampling.max_new_tokens > 0:
                    self._sample(r, logits)

    def _decode(self) -> None:
        rows = [s for s in self._slots if s is not None and s.state is _State.DECODE and not self._is_done(s)]
        if not rows:
            return
        tokens = torch.tensor([r.output_ids[-1] for r in rows], dtype=torch.long)
        positions = torch.tensor([r.filled for r in rows], dtype=torch.long)
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)
        logits = self.model.decode(self.kv, tokens, positions, slots).cpu()  # the running rows only, compacted
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(rows)
        for row, r in enumerate(rows):
            r.filled += 1
            self._sample(r, logits[row])

    def _sample(self, r: _Request, logits: torch.Tensor) -> None:
        token, logprob = sample_token(logits, r.req.sampling, r.generator)
        r.output_ids.append(token)
        r.logprobs.append(logprob)
        r.versions.append(self.version)
        self.stats.sampled_tokens += 1

    def _stop_reason(self, r: _Request) -> tuple[FinishReason, int | str | None] | None:
        sp, last = r.req.sampling, r.output_ids[-1] if r.output_ids else None
        if last is not None:
            if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_token_ids):
                return FinishReason.STOP, last
            if sp.stop:
                # checked after every token, so an occurrence can only be new if it is in the tail
                tail = self.tokenizer.decode(r.output_ids[-64:])
                for s in sp.stop:
                    if s in tail:
                        return FinishReason.STOP, s
        if len(r.output_ids) >= sp.max_new_tokens:
            return FinishReason.LENGTH, None
        return None

    def _is_done(self, r: _Request) -> bool:
        return self._stop_reason(r) is not None

    # ------------------------------------------------------------------------------------------ results
    def _result(self, r: _Request, reason: FinishReason, matched: int | str | None = None) -> GenerateResult:
        return GenerateResult(rid=r.req.rid, output_ids=list(r.output_ids), logprobs=list(r.logprobs),
                              versions=list(r.versions), finish_reason=reason,
                              prompt_tokens=len(r.req.input_ids), cached_tokens=r.cached_tokens,
                              matched_stop=matched)

    def _release_slot(self, r: _Request) -> None:
        if r.slot >= 0:
            self._slots[r.slot] = None
            r.slot = -1

    def _retract_running(self) -> None:
        """Retract every request holding a slot; one paused in place loses its KV, so the pause becomes a retract."""
        for r in [s for s in self._slots if s is not None]:
            self._retract(r)
        if self._paused == "in_place":
            self._paused = "retract"

    def _retract(self, r: _Request) -> None:
        """Free a running request's KV and put it back in the queue; it re-prefills prompt + output so far."""
        valid = r.filled
        self.prefix_cache.insert(r.sequence, valid, lambda a, b, s=r.slot: self.kv.read(s, a, b))
        self._release_slot(r)
        r.state, r.filled = _State.WAITING, 0
        self._waiting.append(r)
        self.stats.retractions += 1

    def _finish(self, r: _Request, reason: FinishReason, matched: int | str | None = None) -> None:
        if r.slot >= 0 and r.filled:
            # keep this sequence's KV for later turns (its last token's KV was never computed)
            self.prefix_cache.insert(r.sequence, r.filled, lambda a, b, s=r.slot: self.kv.read(s, a, b))
            if r.req.keep_warm_s > 0:
                self.prefix_cache.pin(r.sequence, r.filled, self.prefix_cache.now() + r.req.keep_warm_s)
        self._release_slot(r)
        if r in self._waiting:
            self._waiting.remove(r)
        self._flush_stream(r, self._result(r, reason, matched))
        r.send.close()
        self._live.pop(r.req.rid, None)
        self.stats.requests_finished += 1
        if reason is FinishReason.ABORT:
            self.stats.requests_aborted += 1

    def _flush_stream(self, r: _Request, result: GenerateResult | None = None) -> None:
        """Send what ``r`` sampled since its last chunk (with ``result`` on the last one), unless the request
        lets the engine hold it back (``GenerateRequest.stream_tokens``)."""
        unsent = r.output_ids[r.sent:]
        if result is None and (not unsent or may_hold_back(r.req, r.sent, unsent)):
            return
        chunk = GenerateChunk(rid=r.req.rid, token_ids=unsent, logprobs=r.logprobs[r.sent:],
                              versions=r.versions[r.sent:], result=result)
        r.sent = len(r.output_ids)
        try:
            r.send.send_nowait(chunk)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the consumer went away; its abort command is queued

    def _flush_streams(self) -> None:
        for r in list(self._live.values()):
            stop = self._stop_reason(r) if r.state is _State.DECODE else None
            if stop is not None:
                self._finish(r, *stop)
            else:
                self._flush_stream(r)
