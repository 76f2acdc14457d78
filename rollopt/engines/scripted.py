"""A scripted engine for unit tests of scheduling logic only: it returns tokens a script chooses, with a
fixed logprob, after an optional per-token delay. It runs no model; never use it for a performance claim."""

from __future__ import annotations

import array
import bisect
import sys
from typing import Any, AsyncIterator, Callable, Sequence

import anyio
import numpy as np

from rollopt.engines.base import (
    Engine, EngineInfo, FinishReason, GenerateChunk, GenerateRequest, GenerateResult, PauseMode, may_hold_back,
    next_version,
)

Script = Callable[[GenerateRequest], list[int]]


class ScriptedEngine(Engine):
    """Emits ``script(request)`` (cut at ``max_new_tokens``), one token per ``token_delay_s``, one chunk per token
    (or fewer when the request names its ``stream_tokens``).

    ``abort`` ends a request with the tokens emitted so far; ``pause("abort")`` aborts every request in
    flight and ``pause("in_place"|"retract")`` holds emission until ``resume()``; ``update_weights`` bumps the
    version, which tags every later token; ``cached_tokens`` is the longest common prefix with any earlier
    request's input plus output (at most the prompt length minus one), until ``flush_cache()``.
    """

    def __init__(self, script: Script, vocab_size: int = 1000, token_delay_s: float = 0.0,
                 logprob: float = -0.5, eos_token_id: int | None = None, count_cached_tokens: bool = True) -> None:
        self.script, self.vocab_size, self.token_delay_s, self.logprob = script, vocab_size, token_delay_s, logprob
        self.eos_token_id = eos_token_id
        self.count_cached_tokens = count_cached_tokens  # False: every ``cached_tokens`` is 0 (no bookkeeping)
        self.version = 0
        self.requests: list[GenerateRequest] = []
        self._aborted: set[str] = set()
        self._seen: list[bytes] = []  # every earlier sequence as big-endian uint32 bytes, sorted
        self._in_flight: set[str] = set()
        self._running = anyio.Event()
        self._running.set()

    @staticmethod
    def _key(ids: Sequence[int]) -> bytes:
        key = array.array("I", ids)
        if sys.byteorder == "little":
            key.byteswap()  # big-endian: byte order == token-sequence order
        return key.tobytes()

    def _cached(self, ids: Sequence[int]) -> int:
        """The longest common prefix of ``ids`` with any remembered sequence: in lexicographic order the best
        match is a neighbour of ``ids``'s insertion point, so two comparisons suffice."""
        key = self._key(ids)
        at = bisect.bisect_left(self._seen, key)
        best = 0
        for other in self._seen[max(at - 1, 0): at + 1]:
            n = min(len(key), len(other)) // 4
            a, b = np.frombuffer(key, ">u4", n), np.frombuffer(other, ">u4", n)
            differ = np.flatnonzero(a != b)
            best = max(best, int(differ[0]) if differ.size else n)
        return max(0, min(best, len(ids) - 1))

    def _remember(self, ids: Sequence[int]) -> None:
        bisect.insort(self._seen, self._key(ids))

    def _batch_end(self, request: GenerateRequest, planned: list[int], start: int, sent: int) -> int:
        """Where the tokens emitted from ``planned[start]`` on without a scheduling point end: the token-by-token
        loop yields control only after a token it must send (or after a paced token), and stops at a stop
        token, so everything before the first such token can be emitted at once."""
        if self.token_delay_s or not may_hold_back(request, sent, ()):
            return start + 1
        stop = None if request.sampling.ignore_eos else self.eos_token_id
        rest = planned[start:]
        if stop not in rest and may_hold_back(request, sent, rest):  # the common case: nothing to look at
            return len(planned)
        return next(k + 1 for k in range(start, len(planned))
                    if planned[k] == stop or not may_hold_back(request, sent, planned[k:k + 1]))

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        request.sampling.validate()
        self.requests.append(request)
        cached = self._cached(request.input_ids) if self.count_cached_tokens else 0
        planned = self.script(request)[: request.sampling.max_new_tokens]
        out: list[int] = []
        versions: list[int] = []
        reason = FinishReason.LENGTH
        self._in_flight.add(request.rid)
        sent = 0
        while len(out) < len(planned):
            if sent == len(out) or not self._running.is_set():  # a scheduling point per chunk; a pause holds
                await self._running.wait()
            if request.rid in self._aborted:
                reason = FinishReason.ABORT
                break
            if self.token_delay_s:
                await anyio.sleep(self.token_delay_s)
            taken = planned[len(out): self._batch_end(request, planned, len(out), sent)]
            out += taken
            versions += [self.version] * len(taken)
            token = taken[-1]
            if not may_hold_back(request, sent, (token,)):  # the tokens held before it were checked already
                yield GenerateChunk(request.rid, out[sent:], [self.logprob] * (len(out) - sent), versions[sent:])
                sent = len(out)
            if token == self.eos_token_id and not request.sampling.ignore_eos:
                reason = FinishReason.STOP
                break
        else:
            if request.rid in self._aborted:
                reason = FinishReason.ABORT
            elif len(out) < request.sampling.max_new_tokens:
                reason = FinishReason.STOP
        self._in_flight.discard(request.rid)
        if self.count_cached_tokens:
            self._remember((*request.input_ids, *out))
        result = GenerateResult(request.rid, out, [self.logprob] * len(out), versions, reason,
                                prompt_tokens=len(request.input_ids), cached_tokens=cached)
        yield GenerateChunk(request.rid, out[sent:], [self.logprob] * (len(out) - sent), versions[sent:], result=result)

    async def abort(self, rid: str) -> None:
        self._aborted.add(rid)

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode == "abort":
            self._aborted |= self._in_flight
        self._running = anyio.Event()

    async def resume(self) -> None:
        self._running.set()

    async def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        self.version = next_version(self.version, version)
        return self.version

    async def flush_cache(self) -> None:
        self._seen.clear()

    async def health(self) -> bool:
        return True

    async def info(self) -> EngineInfo:
        return EngineInfo("scripted", self.vocab_size, max_context=1 << 20, version=self.version,
                          eos_token_ids=(self.eos_token_id,) if self.eos_token_id is not None else ())
