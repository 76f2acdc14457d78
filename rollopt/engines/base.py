"""The engine interface: one async API with SGLang's semantics, so schedulers behave the same on every engine.

Contract of every engine:

* ``stream(request)`` yields :class:`GenerateChunk` s of newly sampled tokens; the last chunk carries the
  :class:`GenerateResult`. ``generate(request)`` returns that result. Output tokens, logprobs and versions
  always share one length: token ``i`` was sampled by weight version ``versions[i]`` and ``logprobs[i]`` is
  its log-probability under the distribution it was sampled from (the raw softmax for greedy).
* ``abort(rid)`` ends a request early with ``finish_reason == "abort"``; its result keeps every token sampled
  so far, so the caller can resume by appending them to ``input_ids``.
* ``pause("abort")`` aborts everything in flight; ``pause("retract")`` frees running requests' KV and re-queues
  them (they finish normally after ``resume()``); ``pause("in_place")`` stops decoding and keeps the KV.
* ``update_weights(...)`` applies between decode steps and returns the new version; requests in flight are
  retracted around it (their KV freed; SGLang's ``pause_generation(mode="retract")``) and re-prefill prompt +
  output so far on the new weights, then continue and tag their new tokens with it: a token tagged version v
  was computed by v's weights alone (AReaL's recompute; KV kept across the update would mix versions). The
  prefix cache is invalidated.
* Bad requests raise :class:`~rollopt.errors.BadRequestError` naming the problem; the engine keeps serving
  the others. An engine failure mid-request raises :class:`EngineFailure` carrying the partial result.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal, Sequence

from rollopt.config import SamplingParams
from rollopt.errors import BadRequestError, EngineError

PauseMode = Literal["abort", "retract", "in_place"]


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request. ``rid`` must be unique among requests in flight (and, for SGLang, never a
    prefix of another rid). Higher ``priority`` runs first where the engine supports priority. Requests with
    the same ``affinity`` key share a prefix (the executor uses the GRPO group id): a router over several
    servers keeps them on one server for its prefix cache; single engines ignore it.

    ``keep_warm_s``: after the request ends, keep its KV (prompt and output) in the prefix cache for up to this
    many seconds, or until a request that continues the sequence reuses it, so a trajectory whose tools run
    between two turns finds its history warm instead of losing it to LRU eviction. A hint: the embedded engine
    pins the blocks (``PrefixCache.pin``); the SGLang client does not send it (0.5.23's equivalent is a
    streaming session, ``/open_session`` with ``streaming`` and ``timeout``, not used yet).

    ``stream_tokens``: which generated tokens the caller needs to see as soon as they are sampled. None (the
    default) streams every token. A set lets the engine hold tokens back: it sends the first token at once,
    then only a chunk that holds one of these ids, and the last chunk; held tokens ride with the next chunk
    sent. The tokens, their logprobs and versions, and the result are the same either way (an
    :class:`EngineFailure`'s ``partial`` holds the whole output, sent or not). A hint (see
    :func:`may_hold_back`): every engine here follows it (the SGLang server still sends each token; the
    client buffers the ones it may hold back instead of waking the caller). The executor passes the ids that
    can close a tool call when it starts tools early, else an empty set, so a trajectory's task wakes a few
    times per turn instead of once per token.

    ``kv_pool``: which of the engine's KV pools (``EngineInfo.kv_pools``: the servers behind a router, in order)
    the request runs in; None lets the engine choose. A policy that sizes each pool's working set itself (``kv``
    behind a router) places programs with it. A router sends the request to that server while it is healthy and
    keeps the affinity key there; an engine with one pool ignores it."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    affinity: str | None = None
    keep_warm_s: float = 0.0
    stream_tokens: frozenset[int] | None = None
    kv_pool: int | None = None


def may_hold_back(request: GenerateRequest, sent: int, new_ids: Sequence[int]) -> bool:
    """Whether an engine may keep ``new_ids`` (sampled since its last chunk; the request is not finished) for a
    later chunk: only when the request names its ``stream_tokens``, its first token has been sent (``sent``
    tokens were), and none of ``new_ids`` is one of them."""
    watched = request.stream_tokens
    return watched is not None and sent > 0 and watched.isdisjoint(new_ids)


@dataclass(frozen=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    matched_stop: int | str | None = None

    def __post_init__(self) -> None:
        if not (len(self.output_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError("output_ids, logprobs and versions must share one length")


@dataclass(frozen=True)
class GenerateChunk:
    """Tokens sampled since the previous chunk; ``result`` is set on the last chunk of a request."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    result: GenerateResult | None = None


class EngineFailure(EngineError):
    """The engine failed while a request was running. ``partial`` holds every token received before the
    failure (finish reason ``abort``), so the caller can resume without losing or duplicating tokens."""

    def __init__(self, message: str, partial: GenerateResult | None = None) -> None:
        super().__init__(message)
        self.partial = partial


def next_version(current: int, requested: int | None) -> int:
    """The version an update moves to (see :meth:`Engine.update_weights`)."""
    if requested is None:
        return current + 1
    if requested <= current:
        raise BadRequestError(f"weight version {requested} is not after the engine's version {current}; "
                              "versions only grow")
    return requested


@dataclass(frozen=True)
class EngineInfo:
    model: str
    vocab_size: int
    max_context: int
    version: int
    eos_token_ids: tuple[int, ...] = ()
    kv_tokens: int | None = None
    """Tokens of KV the engine can keep between requests (its pool or prefix cache); None: not reported.
    Policies that manage a trajectory's KV across its tool calls size their working set by it."""
    running_kv_tokens: int | None = None
    """Tokens of context the requests of one iteration can hold at most (the KV pool they decode from; SGLang's
    ``max_total_num_tokens``); None: not reported. The benchmark's lower bound counts iterations by it."""
    max_running: int | None = None
    """Requests the engine decodes at once at most (its batch's rows: SGLang's ``max_running_requests``); more wait
    in its queue, in its order, not the client's. Behind a router, the servers' sum. None: not reported."""
    kv_pools: int = 1
    """How many separate KV pools ``kv_tokens`` sums (the servers behind a router), each ``kv_tokens / kv_pools``
    tokens: a policy that sizes its working set by the sum cannot see one pool overflowing while the others have
    room, so it places its requests itself (``GenerateRequest.kv_pool``)."""


class Engine(abc.ABC):
    """Base class of inference engines; use as ``async with engine:``."""

    async def __aenter__(self) -> "Engine":
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    @abc.abstractmethod
    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Yield chunks of new tokens; the last one carries the result."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """The result of :meth:`stream` (its last chunk carries it). Runs the stream to its end rather than
        returning at the result, so no async generator is left unexhausted: trio warns about one collected before
        its end (and the test suite turns warnings into errors)."""
        result = None
        async for chunk in self.stream(request):
            result = chunk.result or result
        if result is None:
            raise EngineError(f"request {request.rid}: stream ended without a result")
        return result

    @abc.abstractmethod
    async def abort(self, rid: str) -> None: ...

    @abc.abstractmethod
    async def pause(self, mode: PauseMode = "abort") -> None: ...

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        """Load new weights; return the new version: ``version`` when given (it must be greater than the current
        one, e.g. when a resumed trainer re-syncs its checkpoint), else the current version + 1."""

    @abc.abstractmethod
    async def flush_cache(self) -> None: ...

    @abc.abstractmethod
    async def health(self) -> bool: ...

    @abc.abstractmethod
    async def info(self) -> EngineInfo: ...
