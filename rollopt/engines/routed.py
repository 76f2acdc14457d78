"""Rollout over several engines (SGLang servers) behind one :class:`~rollopt.engines.base.Engine`.

``async with RoutedEngine([SGLangEngine(url) for url in urls]) as engine:`` opens every engine, checks they serve
the same model at the same weight version, and from then on behaves like one engine:

* **Routing** (:mod:`rollopt.engines.routing`): a request goes to the server its affinity key (the GRPO group id
  the executor sets, else its first prompt tokens) is pinned to; a new key is placed by rendezvous hashing with
  a bounded-load rule. So a group's shared prompt and every later turn of its trajectories hit one server's
  prefix cache, and a batch of groups spreads evenly; a key whose server falls far behind the others moves to
  the least loaded one (rebalancing). A request that names its ``kv_pool`` (a policy placing programs by each
  server's KV) goes to that server while it is healthy. :meth:`stats` reports, per server, requests, prompt,
  cached and generated tokens (cache hit rate = cached / prompt), requests in flight, failures, health and the
  weight version.
* **Fan-out**: ``update_weights``, ``pause``, ``resume``, ``flush_cache`` go to every healthy server at once
  (``flush_cache`` also forgets the key pins).
  Each server's version is recorded; after an update every healthy server must report the new version, else
  :class:`VersionMismatch` (also raised at open if the servers disagree).
* **Failover, inside the router**: when a server fails a request (:class:`EngineFailure`: connection lost, 5xx),
  it is marked unhealthy and drained (no new requests; its other requests in flight are aborted there, best
  effort, and each resumes elsewhere as soon as its own stream ends or fails). A request is resumed on the next
  server with ``input_ids + tokens so far`` and ``max_new_tokens - tokens so far``: the caller's stream simply
  continues, every token yielded exactly once (tokens in the failure's ``partial`` beyond those streamed are
  yielded first), and the result's ``output_ids``/``logprobs``/``versions`` are all segments back to back.
  The executor does not resume after an ``EngineFailure`` (it fails the trajectory, keeping its tokens), which
  is why resumption lives here. A resumed segment gets the sampling seed ``seed + 104729·segment`` (as the
  executor does for its own resumptions); greedy requests continue exactly as an uninterrupted one. Stop
  *strings* that straddle the failure point are not re-checked; a stop token id (``stop_token_ids``, or EOS
  unless ``ignore_eos``) as the last token before the failure finishes the request with ``stop``.
  ``prompt_tokens``/``cached_tokens`` of the result are the first segment's (the re-prefill of a resumed
  segment shows in the new server's stats). When no healthy server is left, :class:`NoHealthyServer` (an
  ``EngineFailure`` with every token so far) is raised.
* Bad requests (:class:`BadRequestError`) are the caller's, never a server failure: they propagate unchanged.

Why client-side and not SGLang's ``sglang-router``: its wheel (0.3.2, Rust, 31 MB) installs from PyPI here, but it
is a separate HTTP gateway process in front of the servers, and (1) its cache-aware policy matches prefixes of
request *text*, while rollopt sends token ids (token-in, token-out) and knows the exact affinity (group id);
(2) it retries a request only before streaming starts, so a server dying mid-stream loses the request's
position, while here the stream continues on another server from its partial tokens; (3) the client would not
see which server produced a token or each server's weight version. This router is a few hundred lines over the engine
interface, works with any engine (the tests also run it over scripted engines), and needs no extra process.
Limits: a server marked unhealthy stays out until a new ``RoutedEngine`` is opened; the weight broadcast over
``torch.distributed`` (``SGLangEngine.update_weights_from_distributed``) is per server, not fanned out here.
"""

from __future__ import annotations

from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import anyio

from rollopt import seeds
from rollopt.engines.base import (
    Engine,
    EngineFailure,
    EngineInfo,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    next_version,
)
from rollopt.engines.routing import AffinityRouter, NoHealthyServer, affinity_key
from rollopt.errors import BadRequestError, ConfigError, EngineError

SEGMENT_SEED_STRIDE = seeds.SEGMENT


class VersionMismatch(EngineError):
    """The healthy servers hold different weight versions (``versions``: server name → version)."""

    def __init__(self, message: str, versions: dict[str, int]) -> None:
        super().__init__(message)
        self.versions = versions


class AllServersFailed(NoHealthyServer, EngineFailure):
    """No healthy server is left for a request; ``partial`` holds every token it got (finish reason abort)."""


@dataclass
class ServerStats:
    """What one server did through this router (a snapshot from :meth:`RoutedEngine.stats`)."""

    name: str
    healthy: bool = True
    version: int = 0
    in_flight: int = 0
    requests: int = 0  # segments sent (a resumed request counts once on each server it used)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    failures: int = 0  # requests that failed here (the first one marks the server unhealthy)
    last_error: str = ""

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(eq=False)
class _Flight:
    """A caller's request across its segments: every token yielded so far, and where it runs now."""

    request: GenerateRequest
    key: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    segments: int = 0
    server: int | None = None  # while a segment is running
    segment_start: int = 0  # offset of the running segment's first token
    first: GenerateResult | None = None  # the first segment's result or partial (prompt/cached counts)
    abort_requested: bool = False  # by the caller
    abort_forwarded: bool = False
    draining: bool = False  # the router aborted it on an unhealthy server; resume elsewhere

    def segment(self) -> GenerateRequest:
        s = self.request.sampling
        seed = None if s.seed is None else s.seed + SEGMENT_SEED_STRIDE * self.segments
        return replace(self.request, input_ids=self.request.input_ids + tuple(self.output_ids),
                       sampling=replace(s, max_new_tokens=s.max_new_tokens - len(self.output_ids), seed=seed))

    def take(self, ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        self.output_ids += ids
        self.logprobs += logprobs
        self.versions += versions

    def result(self, reason: FinishReason, last: GenerateResult | None = None) -> GenerateResult:
        first = self.first or last
        return GenerateResult(rid=self.request.rid, output_ids=list(self.output_ids), logprobs=list(self.logprobs),
                              versions=list(self.versions), finish_reason=reason,
                              prompt_tokens=first.prompt_tokens if first else len(self.request.input_ids),
                              cached_tokens=first.cached_tokens if first else 0,
                              matched_stop=last.matched_stop if last else None)

    def finished_without_server(self, eos_token_ids: Sequence[int]) -> FinishReason | None:
        """Whether the tokens so far already end the request (so no segment is needed)."""
        s = self.request.sampling
        stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))
        if self.output_ids and self.output_ids[-1] in stops:
            return FinishReason.STOP
        if len(self.output_ids) >= s.max_new_tokens and s.max_new_tokens > 0:
            return FinishReason.LENGTH
        return None


class RoutedEngine(Engine):
    """One engine over several; see the module docstring for routing, fan-out and failover.

    Args:
        engines: the backends (typically ``SGLangEngine`` s); the router opens and closes them.
        names: one distinct name per backend (rendezvous identities and stats labels; default: the backend's
            ``base_url`` if it has one, else its index).
        epsilon: the bounded-load slack of :class:`~rollopt.engines.routing.AffinityRouter`.
        prefix_tokens: how many leading prompt tokens make the key of a request without ``affinity``.
        max_keys: how many key pins to remember.
        drain_timeout_s: how long the router waits for each abort it sends to a server it drains.
        rebalance_abs, rebalance_rel: when a pinned key moves off an overloaded server (see
            :class:`~rollopt.engines.routing.AffinityRouter`; ``rebalance_abs=None``: never).
    """

    def __init__(self, engines: Sequence[Engine], *, names: Sequence[str] | None = None, epsilon: float = 0.1,
                 prefix_tokens: int = 64, max_keys: int = 65536, drain_timeout_s: float = 5.0,
                 rebalance_abs: int | None = 16, rebalance_rel: float = 1.25) -> None:
        if names is None:
            names = [str(getattr(e, "base_url", i)) for i, e in enumerate(engines)]
        if len(names) != len(engines):
            raise ConfigError(f"{len(engines)} engines but {len(names)} names")
        if prefix_tokens < 1:
            raise ConfigError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
        self.engines = list(engines)
        self.router = AffinityRouter(names, epsilon=epsilon, max_keys=max_keys, rebalance_abs=rebalance_abs,
                                     rebalance_rel=rebalance_rel)
        self.prefix_tokens = prefix_tokens
        self.drain_timeout_s = drain_timeout_s
        self.version = 0
        self._stats = [ServerStats(name) for name in names]
        self._flights: dict[str, _Flight] = {}
        self._info: EngineInfo | None = None
        self._stack: AsyncExitStack | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "RoutedEngine":
        if self._stack is not None:
            raise RuntimeError("RoutedEngine is already open")
        async with AsyncExitStack() as stack:
            for engine in self.engines:
                await stack.enter_async_context(engine)
            infos = [await engine.info() for engine in self.engines]
            models = {(i.vocab_size, i.eos_token_ids) for i in infos}
            if len(models) > 1:
                raise ConfigError(f"the servers serve different models (vocab size, EOS ids): {sorted(models)}")
            for stats, info in zip(self._stats, infos):
                stats.version = info.version
            self._check_versions()
            self.version = infos[0].version
            kv, running = [i.kv_tokens for i in infos], [i.running_kv_tokens for i in infos]
            rows = [i.max_running for i in infos]
            self._info = replace(infos[0], max_context=min(i.max_context for i in infos),
                                 kv_tokens=None if None in kv else sum(kv),  # type: ignore[arg-type]
                                 running_kv_tokens=None if None in running else min(running),  # one server's batch
                                 max_running=None if None in rows else sum(rows),  # type: ignore[arg-type]
                                 kv_pools=sum(i.kv_pools for i in infos))
            self._stack = stack.pop_all()
        return self

    async def __aexit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:  # no shield here: each engine's exit shields its own cleanup, and under trio a
            await stack.aclose()  # member's task group must not be exited inside a scope opened after it

    def _check_open(self) -> None:
        if self._stack is None:
            raise RuntimeError("use the engine inside `async with RoutedEngine(...) as engine:`")

    # ------------------------------------------------------------------------------------------ state
    def stats(self) -> list[ServerStats]:
        """Per-server counters, in the order of ``engines``."""
        for stats, n, ok in zip(self._stats, self.router.in_flight, self.router.healthy):
            stats.in_flight, stats.healthy = n, ok
        return [replace(s) for s in self._stats]

    def describe(self) -> str:
        """One line for outputs: how many servers, and the first one's own description where it has one."""
        first = getattr(self.engines[0], "describe", None)
        return f"{len(self.engines)} servers behind RoutedEngine" + (f", each a {first()}" if first else "")

    def server_of(self, rid: str) -> str | None:
        """The name of the server running request ``rid`` now (``None`` if it is not in flight)."""
        flight = self._flights.get(rid)
        return None if flight is None or flight.server is None else self.router.names[flight.server]

    def _check_versions(self) -> None:
        versions = {s.name: s.version for s, ok in zip(self._stats, self.router.healthy) if ok}
        if len(set(versions.values())) > 1:
            raise VersionMismatch(f"the servers hold different weight versions: {versions}", versions)

    def _healthy(self) -> list[int]:
        return [i for i, ok in enumerate(self.router.healthy) if ok]

    async def _mark_unhealthy(self, index: int, error: BaseException) -> None:
        """Take server ``index`` out of routing and drain it: abort its requests in flight there so they resume
        elsewhere (best effort: a dead server's streams fail by themselves)."""
        stats = self._stats[index]
        stats.failures += 1
        stats.last_error = f"{type(error).__name__}: {error}"
        if not self.router.healthy[index]:
            return
        self.router.mark_unhealthy(index)
        for flight in [f for f in self._flights.values() if f.server == index]:
            flight.draining = True
            with anyio.move_on_after(self.drain_timeout_s):
                try:
                    await self.engines[index].abort(flight.request.rid)
                except EngineError:
                    pass  # unreachable: its stream fails and resumes elsewhere

    # ------------------------------------------------------------------------------------------ generate
    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self._check_open()
        request.sampling.validate()
        if request.rid in self._flights:
            raise BadRequestError(f"request id {request.rid!r} is already in flight; rids must be unique")
        flight = _Flight(request, affinity_key(request, self.prefix_tokens))
        self._flights[request.rid] = flight
        try:
            while True:
                if flight.abort_requested:
                    yield self._last_chunk(flight, flight.result(FinishReason.ABORT))
                    return
                if flight.segments:
                    done = flight.finished_without_server(self._info.eos_token_ids if self._info else ())
                    if done is not None:
                        yield self._last_chunk(flight, flight.result(done))
                        return
                async with aclosing(self._segment(flight)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                        if chunk.result is not None:
                            return
        finally:
            del self._flights[request.rid]

    async def _segment(self, flight: _Flight) -> AsyncIterator[GenerateChunk]:
        """Run the next segment of ``flight`` on the server its key routes to: yield its chunks; end without a
        result chunk when that server cut it short (failure or drain), so the caller resumes elsewhere."""
        segment = flight.segment()
        try:
            index = self.router.route(flight.key, flight.request.kv_pool)
        except NoHealthyServer as exc:
            why = "; ".join(f"{s.name}: {s.last_error}" for s in self._stats if s.last_error)  # what took each out
            raise AllServersFailed(f"request {flight.request.rid}: {exc} ({why})",
                                   partial=flight.result(FinishReason.ABORT)) from None
        stats, engine = self._stats[index], self.engines[index]
        flight.server, flight.segment_start = index, len(flight.output_ids)
        flight.segments += 1
        flight.abort_forwarded = flight.draining = False
        stats.requests += 1
        try:
            try:
                async with aclosing(engine.stream(segment)) as chunks:
                    async for chunk in chunks:
                        if flight.abort_requested and not flight.abort_forwarded:
                            flight.abort_forwarded = True
                            await engine.abort(flight.request.rid)
                        flight.take(chunk.token_ids, chunk.logprobs, chunk.versions)
                        stats.generated_tokens += len(chunk.token_ids)
                        result = chunk.result
                        if result is None:
                            if chunk.token_ids:
                                yield chunk
                            continue
                        self._count_prefill(stats, flight, result)
                        flight.versions[flight.segment_start:] = result.versions  # exact, from the server
                        if result.finish_reason is FinishReason.ABORT and flight.draining \
                                and not flight.abort_requested:
                            if chunk.token_ids:
                                yield replace(chunk, versions=flight.versions[-len(chunk.token_ids):], result=None)
                            return  # drained: resume elsewhere
                        yield self._last_chunk(flight, flight.result(result.finish_reason, result),
                                               chunk.token_ids)
                        return
                raise EngineFailure(f"request {flight.request.rid}: the stream of {self.router.names[index]} "
                                    "ended without a result")  # broke the Engine contract: treat as a failure
            except EngineFailure as exc:
                flight.server = None  # not drained with the others: it resumes below
                if exc.partial is not None:
                    self._count_prefill(stats, flight, exc.partial)
                extra = self._take_partial(flight, exc.partial)
                stats.generated_tokens += len(extra.token_ids) if extra else 0
                await self._mark_unhealthy(index, exc)
                if extra is not None:
                    yield extra
        finally:
            flight.server = None
            self.router.release(index)

    @staticmethod
    def _count_prefill(stats: ServerStats, flight: _Flight, result: GenerateResult) -> None:
        stats.prompt_tokens += result.prompt_tokens
        stats.cached_tokens += result.cached_tokens
        if flight.first is None:
            flight.first = result

    @staticmethod
    def _take_partial(flight: _Flight, partial: GenerateResult | None) -> GenerateChunk | None:
        """The tokens of a failed segment's ``partial`` beyond those already streamed, as a chunk (or None)."""
        if partial is None:
            return None
        streamed = len(flight.output_ids) - flight.segment_start
        if len(partial.output_ids) <= streamed:
            return None
        cut = slice(streamed, len(partial.output_ids))
        chunk = GenerateChunk(flight.request.rid, partial.output_ids[cut], partial.logprobs[cut],
                              partial.versions[cut])
        flight.take(chunk.token_ids, chunk.logprobs, chunk.versions)
        return chunk

    @staticmethod
    def _last_chunk(flight: _Flight, result: GenerateResult, new_ids: Sequence[int] = ()) -> GenerateChunk:
        n = len(new_ids)
        return GenerateChunk(flight.request.rid, list(new_ids), flight.logprobs[len(flight.logprobs) - n:],
                             flight.versions[len(flight.versions) - n:], result=result)

    # ------------------------------------------------------------------------------------------ control
    async def abort(self, rid: str) -> None:
        """Abort one request (a no-op if it is not in flight); it ends with every token so far."""
        flight = self._flights.get(rid)
        if flight is None:
            return
        flight.abort_requested = True
        if flight.server is not None:  # sent again with the segment's next chunk, in case it was not yet known
            await self.engines[flight.server].abort(rid)

    async def _fan_out(self, call: Callable[[int, Engine], Awaitable[None]]) -> None:
        """Run ``call`` on every healthy server at once. A server that raised and then fails its health check is
        marked unhealthy (and drained); any other error is raised once every call has ended."""
        errors: dict[int, Exception] = {}

        async def one(i: int) -> None:
            try:
                await call(i, self.engines[i])
            except Exception as exc:  # collected; cancellation is not an Exception and propagates
                errors[i] = exc

        async with anyio.create_task_group() as tg:
            for i in self._healthy():
                tg.start_soon(one, i)
        for i, exc in sorted(errors.items()):
            if isinstance(exc, BadRequestError) or await self.engines[i].health():
                raise exc
            await self._mark_unhealthy(i, exc)
        if not self._healthy():
            raise NoHealthyServer(f"no healthy server left among {list(self.router.names)}")

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._fan_out(lambda i, e: e.pause(mode))

    async def resume(self) -> None:
        await self._fan_out(lambda i, e: e.resume())

    async def flush_cache(self) -> None:
        """Flush every healthy server's cache and forget the router's key pins: a pin exists only because its
        server holds the key's prefix, so after a flush each key is placed afresh by the loads of that moment.
        (Without this a benchmark's second policy ran on the placement the first policy's loads had chosen.)"""
        await self._fan_out(lambda i, e: e.flush_cache())
        self.router.forget_pins()

    async def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        """Load ``weights`` on every healthy server (as each backend's ``update_weights`` takes them); every one
        must end at the same new version (:class:`VersionMismatch` otherwise)."""
        target = next_version(self.version, version)

        async def update(i: int, engine: Engine) -> None:
            self._stats[i].version = await engine.update_weights(weights, version=target)

        try:
            await self._fan_out(update)
        except EngineError:
            self._check_versions()  # some servers updated and others did not: say so, not only why
            raise
        self._check_versions()
        self.version = target
        return target

    async def health(self) -> bool:
        """Probe every healthy server; mark those that fail unhealthy. True while at least one is healthy."""
        for i in self._healthy():
            if not await self.engines[i].health():
                await self._mark_unhealthy(i, EngineError("health check failed"))
        return bool(self._healthy())

    async def info(self) -> EngineInfo:
        self._check_open()
        assert self._info is not None
        return replace(self._info, version=self.version)

    def __repr__(self) -> str:
        return f"RoutedEngine({list(self.router.names)!r}, version={self.version}, live={len(self._flights)})"


__all__ = ["AllServersFailed", "RoutedEngine", "ServerStats", "VersionMismatch"]
