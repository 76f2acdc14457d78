"""The SGLang engine: an async client of SGLang's native HTTP API with the semantics of ``base.Engine``.

Supported server: ``sglang==0.5.23`` (field names below are from its ``sglang/srt/managers/io_struct.py``,
``sglang/srt/entrypoints/http_server.py`` and ``sglang/srt/managers/tokenizer_manager.py``). Start one with
``rollopt.engines.sglang_server.SGLangServer`` or ``rollopt serve-sglang``; use it as
``async with SGLangEngine(base_url) as engine:`` (the ``httpx.AsyncClient`` lives inside that block).

How the interface maps onto the server:

* ``stream``/``generate``: ``POST /generate`` with ``input_ids``, ``sampling_params``
  (``SamplingParams.to_sglang()``), ``rid``, ``return_logprob: true``, ``stream: true``; the answer is SSE lines
  ``data: {...}`` ending with ``data: [DONE]``. With the server's default ``incremental_streaming_output=False``
  every chunk's ``output_ids`` and ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``) are
  cumulative; with it on they are deltas. The client reads that flag from ``/server_info`` and handles both.
  A chunk's ``meta_info.finish_reason`` is ``null`` until the last one: ``{"type": "stop", "matched": ...}``,
  ``{"type": "length"}`` or ``{"type": "abort", "status_code": ...}``. Errors inside a stream come as
  ``data: {"error": {"message", "code"}}``.
* versions: SGLang's ``weight_version`` is a string; the final chunk carries ``meta_info.weight_versions``,
  spans ``{version, start, end}`` over output-token indices, which give each token's version (older servers:
  ``meta_info.weight_version``). The client keeps the integer counter: the server's version string at connect
  maps to ``initial_version`` (default: its integer value if numeric, else 0) and every successful update sends
  ``weight_version=str(new_version)``, so later tags are the integers themselves. Chunks tag new tokens with the
  server's current version when the chunk was sent (provisional); the result's ``versions`` come from the spans.
* request ids: SGLang aborts every rid that *starts with* the given one, so the client sends a prefix-free
  encoding ``f"{len(rid)}.{rid}.{client_id}.{n}$"`` and maps it back; results carry the caller's rid.
* ``abort(rid)``: ``POST /abort_request {"rid"}``. The aborted stream ends normally with ``finish_reason`` abort
  and every token so far. An abort that reaches the server before the request does is re-sent once the first
  chunk arrives.
* ``pause(mode)``: ``POST /pause_generation {"mode"}`` (``abort`` / ``retract`` / ``in_place``);
  ``resume()``: ``POST /continue_generation``. New requests wait while paused.
* ``update_weights(path | state_dict)``: ``/update_weights_from_disk {"model_path", "weight_version"}`` or
  ``/begin_weight_update``, ``/update_weights_from_tensor {"serialized_named_tensors", "weight_version"}``,
  ``/end_weight_update`` (0.5.23 answers 400 outside begin/end; the same holds for the distributed update). So that requests in flight continue under the
  new weights (as on the local engine) instead of SGLang's default of waiting for them to finish, the update
  runs under ``pause("retract")`` (running requests keep their tokens, free their KV and re-prefill under the
  new weights after ``/continue_generation``) with ``flush_cache: true``, which clears the radix cache. If the
  caller had paused in ``in_place`` mode the server is switched to ``retract`` (SGLang cannot flush the cache
  while requests hold KV) and stays paused. The tensors are pickled *by value* (``torch.save``'d storages inside
  the pickle), which SGLang's ``SafeUnpickler`` accepts; unlike ``ForkingPickler`` this needs no shared memory,
  no ``torch.multiprocessing.set_sharing_strategy`` (process-global) and no ``torch_shm_manager`` process, at the
  cost of sending the bytes over HTTP.
* ``init_weights_update_group`` / ``update_weights_from_distributed``: SGLang's weight broadcast from the trainer
  (rank 0 of a separate torch.distributed group; :func:`init_trainer_weight_group` and
  :func:`broadcast_weights` are the trainer's half, run concurrently). The tests run it on CPU with gloo.
* ``flush_cache()``: ``POST /flush_cache``; the server answers 400 while requests are queued or running, so the
  client retries a bounded number of times, then raises ``EngineError``.
* ``health()``: ``GET /health_generate`` (it decodes one token, so while this client has the server paused it
  checks liveness with ``GET /model_info`` instead); ``info()``: ``/model_info`` + ``/v1/models``
  (``max_model_len``) + the model's ``config.json`` (vocab size, EOS ids) when ``model_path`` is local.

Failures: token ids outside the vocabulary are rejected by the client (sglang 0.5.23 on CPU crashes the whole
server on them: ``IndexError`` in the embedding); HTTP 4xx and in-stream errors with a 4xx code raise
:class:`~rollopt.errors.BadRequestError` with the server's message; an unreachable server, a 5xx, or a connection
lost mid-stream raise :class:`EngineFailure` whose ``partial`` holds every token received (finish reason abort),
so the caller can resume by appending them to ``input_ids``. No raw ``httpx`` exception escapes.
"""

from __future__ import annotations

import io
import itertools
import json
import pickle
import uuid
from base64 import b64encode
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Sequence

import anyio
import httpx

from rollopt.engines.base import (
    Engine,
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
from rollopt.errors import BadRequestError, ConfigError, EngineError

SGLANG_VERSION = "0.5.23"


def encode_rid(rid: str, client_id: str, n: int) -> str:
    """A prefix-free wire rid: no result of this function is a proper prefix of another (the length field fixes
    where ``rid`` ends; ``client_id`` is hex and ``n`` digits, each closed by a terminator)."""
    return f"{len(rid)}.{rid}.{client_id}.{n}$"


def versions_from_spans(spans: Sequence[Mapping[str, Any]], n: int, to_int) -> list[int] | None:
    """Per-token versions from SGLang's ``weight_versions`` spans; ``None`` if they do not cover ``n`` tokens."""
    out: list[int | None] = [None] * n
    for span in spans:
        v = to_int(span["version"])
        for i in range(max(0, span["start"]), min(n, span["end"])):
            out[i] = v
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


@dataclass
class _Live:
    """A request in flight: what the caller has been sent so far."""

    request: GenerateRequest
    wire: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int | None = None  # as the server counted them
    registered: bool = False  # the server has answered at least once, so it knows the rid
    sent: int = 0  # output tokens already passed to the caller (the rest are held back: ``stream_tokens``)
    abort_requested: bool = False
    abort_resent: bool = False

    def partial(self) -> GenerateResult:
        return GenerateResult(rid=self.request.rid, output_ids=list(self.output_ids), logprobs=list(self.logprobs),
                              versions=list(self.versions), finish_reason=FinishReason.ABORT,
                              prompt_tokens=self.prompt_tokens if self.prompt_tokens is not None
                              else len(self.request.input_ids), cached_tokens=self.cached_tokens)


def _message(response_text: str) -> str:
    try:
        body = json.loads(response_text)
    except ValueError:
        return response_text.strip()
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return response_text.strip()


def serialize_named_tensors(state_dict: Mapping[str, Any]) -> str:
    """Base64 of a by-value pickle of ``[(name, tensor), ...]`` (SGLang's ``serialized_named_tensors`` entry)."""
    items = []
    for name, t in state_dict.items():
        t = t.detach().cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.contiguous().clone()  # send only this tensor's bytes, not a larger shared storage
        items.append((name, t))
    buf = io.BytesIO()
    pickle.dump(items, buf, protocol=pickle.HIGHEST_PROTOCOL)
    return b64encode(buf.getvalue()).decode("ascii")


def weight_metadata(state_dict: Mapping[str, Any]) -> tuple[list[str], list[str], list[list[int]]]:
    """``(names, dtypes, shapes)`` of a state dict, as ``update_weights_from_distributed`` takes them."""
    names = list(state_dict)
    return (names, [str(state_dict[n].dtype).removeprefix("torch.") for n in names],
            [list(state_dict[n].shape) for n in names])


def init_trainer_weight_group(master_address: str, master_port: int, world_size: int,
                              group_name: str = "weight_update_group", backend: str = "nccl",
                              timeout_s: float | None = None):
    """The trainer's side (rank 0) of the weight-update group that an SGLang server joins with
    :meth:`SGLangEngine.init_weights_update_group`; blocks until all ``world_size`` ranks have joined.

    The group is made outside the default process group, so a trainer's own ``torch.distributed`` world (FSDP)
    is untouched; this mirrors ``sglang.srt.utils.common.init_custom_process_group`` (used on the server side)
    and, like it, relies on ``torch.distributed.distributed_c10d`` internals (checked with torch 2.14.1)."""
    from datetime import timedelta

    from torch.distributed.distributed_c10d import (
        Backend, PrefixStore, _new_process_group_helper, _world, default_pg_timeout, rendezvous)

    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else default_pg_timeout
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size,
                                              timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                         group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_weights(state_dict: Mapping[str, Any], group) -> None:
    """Broadcast every tensor of ``state_dict`` from rank 0 of ``group``, in order (the trainer's half of
    :meth:`SGLangEngine.update_weights_from_distributed`)."""
    import torch.distributed as dist

    for tensor in state_dict.values():
        dist.broadcast(tensor.detach().contiguous(), src=0, group=group)


class SGLangEngine(Engine):
    """A client of one SGLang server; see the module docstring for the mapping and the failure contract.

    Args:
        base_url: e.g. ``http://127.0.0.1:30000``.
        request_timeout_s: timeout of control calls (weight updates included).
        connect_timeout_s: TCP connect timeout.
        stream_read_timeout_s: longest silence allowed inside a generate stream (``None``: no limit; a dead
            server is seen as a closed connection).
        flush_attempts, flush_retry_s: how often and how far apart ``flush_cache`` retries while busy.
        vocab_size, eos_token_ids: override what is read from the model's ``config.json`` (needed when the
            server's ``model_path`` is not readable from this machine).
        initial_version: the integer version of the weights the server has now (default: see module docs).
        max_connections: HTTP connection pool size (one connection per concurrent stream).
    """

    def __init__(self, base_url: str, *, request_timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 stream_read_timeout_s: float | None = None, flush_attempts: int = 50, flush_retry_s: float = 0.2,
                 vocab_size: int | None = None, eos_token_ids: Sequence[int] | None = None,
                 initial_version: int | None = None, max_connections: int = 1024) -> None:
        if flush_attempts < 1:
            raise ConfigError(f"flush_attempts must be >= 1, got {flush_attempts}")
        self.base_url = base_url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.stream_read_timeout_s = stream_read_timeout_s
        self.flush_attempts = flush_attempts
        self.flush_retry_s = flush_retry_s
        self.max_connections = max_connections
        self.version = 0
        self.model_path = ""
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids) if eos_token_ids is not None else None
        self.max_context = 0
        self.kv_tokens: int | None = None  # the server's KV pool in tokens, once connected (if it reports it)
        self.max_running: int | None = None  # the server's running-request limit, once connected (likewise)
        self.incremental_stream = False
        self._initial_version = initial_version
        self._initial_tag: str | None = None
        self._client_id = uuid.uuid4().hex[:8]
        self._counter = itertools.count()
        self._live: dict[str, _Live] = {}  # by caller rid
        self._paused: PauseMode | None = None
        self._update_lock = anyio.Lock()  # one weight update at a time
        self._client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "SGLangEngine":
        if self._client is not None:
            raise RuntimeError("SGLangEngine is already open")
        self._client = httpx.AsyncClient(
            base_url=self.base_url, trust_env=False,
            timeout=httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s),
            limits=httpx.Limits(max_connections=self.max_connections, max_keepalive_connections=64))
        try:
            await self._connect()
        except BaseException:
            await self._client.aclose()
            self._client = None
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            with anyio.CancelScope(shield=True):
                await self._client.aclose()
            self._client = None

    async def _connect(self) -> None:
        model = await self._get("/model_info")
        server = await self._get_server_info()
        self.model_path = str(model.get("model_path") or model.get("served_model_name") or "")
        self._initial_tag = str(model.get("weight_version", "default"))
        if self._initial_version is None:
            self._initial_version = int(self._initial_tag) if self._initial_tag.isdigit() else 0
        self.version = self._initial_version
        self.incremental_stream = bool(server.get("incremental_streaming_output", False))
        self.kv_tokens = _reported_size(server, "max_total_num_tokens")  # the KV pool, for policies that size by it
        self.max_running = _reported_size(server, *MAX_RUNNING_KEYS)
        try:
            models = await self._get("/v1/models")
            self.max_context = int(models["data"][0]["max_model_len"])
        except (EngineError, KeyError, IndexError, TypeError, ValueError):
            # sglang/srt/managers/tp_worker.py: max_req_input_len = min(context_len - 1, kv - 1) - 5
            self.max_context = int(server.get("context_length") or server.get("max_req_input_len", 0) + 6)
        self._read_model_config()

    def _read_model_config(self) -> None:
        path = Path(self.model_path)
        config: dict[str, Any] = {}
        if (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
        if self.vocab_size is None:
            vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
            if vocab is None:
                raise EngineError(
                    f"cannot read the vocabulary size of {self.model_path!r} from this machine (no config.json); "
                    "pass SGLangEngine(..., vocab_size=N, eos_token_ids=[...])")
            self.vocab_size = int(vocab)
        if self.eos_token_ids is None:
            eos = None
            if (path / "generation_config.json").is_file():
                eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
            if eos is None:
                eos = config.get("eos_token_id")
            self.eos_token_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("use the engine inside `async with SGLangEngine(...) as engine:`")
        return self._client

    # ------------------------------------------------------------------------------------------ HTTP helpers
    async def _call(self, method: str, path: str, body: dict | None = None,
                    params: dict | None = None) -> httpx.Response:
        try:
            response = await self._http().request(method, path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise EngineError(f"SGLang server {self.base_url} {method} {path} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        if 400 <= response.status_code < 500:
            raise BadRequestError(f"SGLang {path} answered {response.status_code}: {_message(response.text)}")
        if response.status_code >= 500:
            raise EngineError(f"SGLang {path} answered {response.status_code}: {_message(response.text)}")
        return response

    async def _get(self, path: str) -> dict:
        response = await self._call("GET", path)
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"SGLang {path} answered with non-JSON: {response.text[:200]!r}") from exc

    async def _post(self, path: str, body: dict | None = None) -> httpx.Response:
        return await self._call("POST", path, body if body is not None else {})

    async def _get_server_info(self) -> dict:
        try:
            return await self._get("/server_info")
        except BadRequestError:  # older servers: only the deprecated name
            return await self._get("/get_server_info")

    def _version_of(self, tag: Any) -> int:
        tag = str(tag)
        if tag == self._initial_tag and self._initial_version is not None:
            return self._initial_version
        if tag.lstrip("-").isdigit():
            return int(tag)
        raise EngineError(f"SGLang reported weight version {tag!r}, which this client did not set "
                          f"(initial {self._initial_tag!r}); another client is updating weights")

    # ------------------------------------------------------------------------------------------ generate
    def _check_request(self, request: GenerateRequest) -> None:
        request.sampling.validate()
        if not request.input_ids:
            raise BadRequestError(f"request {request.rid}: empty prompt")
        vocab = self.vocab_size or 0
        bad = [t for t in request.input_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise BadRequestError(f"request {request.rid}: token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if request.rid in self._live:
            raise BadRequestError(f"request id {request.rid!r} is already in flight; rids must be unique")

    def _body(self, request: GenerateRequest, wire: str) -> dict[str, Any]:
        body: dict[str, Any] = {"rid": wire, "input_ids": list(request.input_ids),
                                "sampling_params": request.sampling.to_sglang(), "return_logprob": True,
                                "stream": True}
        if request.priority:
            body["priority"] = request.priority
        return body

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        client = self._http()
        self._check_request(request)
        live = _Live(request, encode_rid(request.rid, self._client_id, next(self._counter)))
        self._live[request.rid] = live
        finished = False
        timeout = httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s,
                                read=self.stream_read_timeout_s)
        try:
            try:
                async with client.stream("POST", "/generate", json=self._body(request, live.wire),
                                         timeout=timeout) as response:
                    if response.status_code != 200:
                        text = (await response.aread()).decode("utf-8", "replace")
                        self._raise_status(live, response.status_code, _message(text))
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        try:
                            out = json.loads(data)
                        except json.JSONDecodeError as exc:
                            raise EngineFailure(f"request {request.rid}: undecodable stream data from "
                                                f"{self.base_url}: {data[:200]!r}", partial=live.partial()) from exc
                        chunk = self._on_chunk(live, out)
                        if chunk is not None:
                            finished = chunk.result is not None
                            if finished:
                                self._live.pop(request.rid, None)  # the rid may be reused from now on
                            yield chunk
                            if finished:
                                return
                        if live.abort_requested and not live.abort_resent:
                            live.abort_resent = True
                            await self._send_abort(live.wire)
            except httpx.HTTPError as exc:
                raise EngineFailure(f"request {request.rid}: lost the SGLang server {self.base_url} after "
                                    f"{len(live.output_ids)} tokens: {type(exc).__name__}: {exc}",
                                    partial=live.partial()) from exc
            raise EngineFailure(f"request {request.rid}: the SGLang stream ended without a finish reason after "
                                f"{len(live.output_ids)} tokens", partial=live.partial())
        finally:
            if self._live.get(request.rid) is live:
                del self._live[request.rid]
            if not finished and live.registered and self._client is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    try:
                        await self._send_abort(live.wire)  # the caller went away: free the server's slot
                    except EngineError:
                        pass

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        async with aclosing(self.stream(request)) as chunks:
            async for chunk in chunks:
                if chunk.result is not None:
                    return chunk.result
        raise EngineError(f"request {request.rid}: stream ended without a result")

    def _raise_status(self, live: _Live, status: int, message: str) -> None:
        if 400 <= status < 500:
            raise BadRequestError(f"request {live.request.rid}: SGLang answered {status}: {message}")
        raise EngineFailure(f"request {live.request.rid}: SGLang answered {status}: {message}",
                            partial=live.partial())

    def _on_chunk(self, live: _Live, out: dict[str, Any]) -> GenerateChunk | None:
        if "error" in out:
            err = out["error"] if isinstance(out["error"], dict) else {"message": str(out["error"])}
            self._raise_status(live, int(err.get("code") or 500), str(err.get("message")))
        live.registered = True
        meta = out.get("meta_info", {})
        ids = list(out.get("output_ids") or [])
        lps = [entry[0] for entry in meta.get("output_token_logprobs") or []]
        if not self.incremental_stream:  # cumulative: keep what is new
            ids, lps = ids[len(live.output_ids):], lps[len(live.output_ids):]
        if live.request.sampling.max_new_tokens == 0 and not ids:
            lps = []  # prefill only: SGLang at times reports the logprob of a next token it did not sample
        if len(lps) != len(ids):
            raise EngineFailure(f"request {live.request.rid}: SGLang sent {len(ids)} tokens but {len(lps)} "
                                "logprobs (return_logprob was requested)", partial=live.partial())
        lps = [float("nan") if lp is None else float(lp) for lp in lps]
        provisional = self._version_of(meta.get("weight_version", self._initial_tag))
        live.output_ids += ids
        live.logprobs += lps
        live.versions += [provisional] * len(ids)
        live.cached_tokens = int(meta.get("cached_tokens") or 0)
        if meta.get("prompt_tokens") is not None:
            live.prompt_tokens = int(meta["prompt_tokens"])
        reason = meta.get("finish_reason")
        if reason is None:
            if not ids or may_hold_back(live.request, live.sent, ids):
                return None
            return self._unsent(live)
        spans = meta.get("weight_versions")
        if spans:
            exact = versions_from_spans(spans, len(live.output_ids), self._version_of)
            if exact is not None:
                live.versions = exact
        return self._unsent(live, self._result(live, reason))

    @staticmethod
    def _unsent(live: _Live, result: GenerateResult | None = None) -> GenerateChunk:
        """A chunk of every token not passed to the caller yet (those held back included)."""
        start, live.sent = live.sent, len(live.output_ids)
        return GenerateChunk(rid=live.request.rid, token_ids=live.output_ids[start:], logprobs=live.logprobs[start:],
                             versions=live.versions[start:], result=result)

    def _result(self, live: _Live, reason: dict[str, Any]) -> GenerateResult:
        kind = reason.get("type")
        if kind == "abort" and reason.get("status_code") is not None:
            self._raise_status(live, int(reason["status_code"]), str(reason.get("message")))
        finish = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}.get(kind)
        if finish is None:
            raise EngineFailure(f"request {live.request.rid}: unknown SGLang finish reason {reason!r}",
                                partial=live.partial())
        matched = reason.get("matched") if finish is FinishReason.STOP else None
        return GenerateResult(rid=live.request.rid, output_ids=list(live.output_ids), logprobs=list(live.logprobs),
                              versions=list(live.versions), finish_reason=finish,
                              prompt_tokens=live.partial().prompt_tokens, cached_tokens=live.cached_tokens,
                              matched_stop=matched)

    # ------------------------------------------------------------------------------------------ control
    async def _send_abort(self, wire: str) -> None:
        await self._post("/abort_request", {"rid": wire})

    async def abort(self, rid: str) -> None:
        """Abort one request (a no-op if it is not in flight); its stream ends with finish reason abort."""
        live = self._live.get(rid)
        if live is None:
            return
        live.abort_requested = True
        live.abort_resent = live.registered  # not yet known to the server: send it again after its first chunk
        await self._send_abort(live.wire)

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ConfigError(f"pause mode {mode!r}; use 'abort', 'retract' or 'in_place'")
        await self._post("/pause_generation", {"mode": mode})
        self._paused = mode

    async def resume(self) -> None:
        await self._post("/continue_generation", {})
        self._paused = None

    async def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        """``weights``: a checkpoint directory (``str`` / ``Path``, loaded by the server from its disk) or a state
        dict of HF parameter names to tensors. Returns the new version; see the module docstring."""
        if isinstance(weights, (str, Path)):
            return await self.update_weights_from_disk(weights, version=version)
        if isinstance(weights, Mapping):
            return await self.update_weights_from_tensor(weights, version=version)
        raise BadRequestError(f"update_weights takes a checkpoint path or a state dict, got {type(weights).__name__}")

    async def _versioned_update(self, apply, version: int | None = None) -> int:
        """Run ``apply(version_tag)`` with the server paused in retract mode, then resume unless the caller had
        paused; bump the version only on success."""
        async with self._update_lock:
            new_version = next_version(self.version, version)
            before = self._paused
            if before in (None, "in_place"):
                await self._post("/pause_generation", {"mode": "retract"})
            try:
                await apply(str(new_version))
            finally:
                if before is None:
                    with anyio.CancelScope(shield=True):
                        await self._post("/continue_generation", {})
                elif before == "in_place":
                    self._paused = "retract"
            self.version = new_version
            return new_version

    async def update_weights_from_disk(self, model_path: str | Path, load_format: str | None = None, *,
                                       version: int | None = None) -> int:
        async def apply(tag: str) -> None:
            body: dict[str, Any] = {"model_path": str(model_path), "weight_version": tag, "flush_cache": True}
            if load_format is not None:
                body["load_format"] = load_format
            await self._post("/update_weights_from_disk", body)
        return await self._versioned_update(apply, version)

    async def update_weights_from_tensor(self, state_dict: Mapping[str, Any], load_format: str | None = None, *,
                                         version: int | None = None) -> int:
        payload = await anyio.to_thread.run_sync(serialize_named_tensors, state_dict)

        async def apply(tag: str) -> None:
            await self._post("/begin_weight_update", {})
            try:
                body: dict[str, Any] = {"serialized_named_tensors": [payload], "weight_version": tag,
                                        "flush_cache": True}
                if load_format is not None:
                    body["load_format"] = load_format
                await self._post("/update_weights_from_tensor", body)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._post("/end_weight_update", {})
        return await self._versioned_update(apply, version)

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> None:
        """Join the server's ranks (``rank_offset`` ...) to a torch.distributed group whose rank 0 is the trainer
        (``/init_weights_update_group``). The server blocks until every rank has joined, so the trainer must call
        :func:`init_trainer_weight_group` concurrently (e.g. in a thread). ``backend="gloo"`` works on CPU (the
        tests use it); use ``"nccl"`` between GPUs."""
        await self._post("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: Sequence[str], dtypes: Sequence[str],
                                              shapes: Sequence[Sequence[int]],
                                              group_name: str = "weight_update_group") -> int:
        """Receive the named tensors by broadcast from the trainer (rank 0 of ``group_name``), which must run
        :func:`broadcast_weights` concurrently (same tensors, same order; :func:`weight_metadata` gives the
        arguments). ``dtypes`` are torch dtype names such as ``"float32"``. Returns the new version."""
        async def apply(tag: str) -> None:
            await self._post("/begin_weight_update", {})
            try:
                await self._post("/update_weights_from_distributed", {
                    "names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
                    "group_name": group_name, "weight_version": tag, "flush_cache": True})
            finally:
                with anyio.CancelScope(shield=True):
                    await self._post("/end_weight_update", {})
        return await self._versioned_update(apply)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._post("/destroy_weights_update_group", {"group_name": group_name})

    async def flush_cache(self) -> None:
        """Clear the radix (prefix) cache, retrying while the server is busy (HTTP 400)."""
        last = ""
        for attempt in range(self.flush_attempts):
            try:
                await self._post("/flush_cache")
                return
            except BadRequestError as exc:
                last = str(exc)
            if attempt + 1 < self.flush_attempts:
                await anyio.sleep(self.flush_retry_s)
        raise EngineError(f"SGLang kept refusing /flush_cache after {self.flush_attempts} attempts "
                          f"(requests queued or running): {last}")

    async def health(self) -> bool:
        path = "/model_info" if self._paused is not None else "/health_generate"
        try:
            response = await self._http().get(path, timeout=httpx.Timeout(60.0, connect=self.connect_timeout_s))
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def scheduler_sizes(self) -> dict[str, int | bool]:
        """The server's scheduling sizes from ``/server_info`` (its resolved arguments and the scheduler's
        ``max_total_num_tokens``) and whether its schedule policy defers a shared uncached prefix, named as
        :class:`~rollopt.engines.sim_calibration.EngineSizes`' fields, for
        ``rollopt calibrate``. A size the server does not report is an :class:`EngineError` naming it."""
        info = await self._get_server_info()

        def size(*keys: str) -> int:
            if (value := _reported_size(info, *keys)) is None:
                raise EngineError(f"/server_info reports no positive {' or '.join(keys)}; pass the sizes explicitly")
            return value

        kv_tokens = size("max_total_num_tokens")
        try:
            chunk = size("chunked_prefill_size")
        except EngineError:  # chunked prefill off: a prompt is prefilled whole
            chunk = self.max_context
        # fcfs (0.5.23's default) matches no prefix across the waiting queue: requests that arrive together with
        # one uncached prompt each prefill it; the cache-aware policies deprioritize all but one of them
        policy = str(info.get("schedule_policy", "fcfs"))
        return {"max_running": size(*MAX_RUNNING_KEYS),
                "prefill_chunk": chunk,
                "block_size": size("page_size"), "max_context": self.max_context, "kv_tokens": kv_tokens,
                "defer_shared_prefill": policy in ("lpm", "dfs-weight", "hrrn", "shortest-prefill-first"),
                # without --enable-mixed-chunk the scheduler runs a prefill batch alone whenever it has one
                # ("run prefill first if possible", scheduler.get_next_batch_to_run), decode only otherwise
                "mixed_prefill": bool(info.get("enable_mixed_chunk", False))}

    async def info(self) -> EngineInfo:
        return EngineInfo(model=self.model_path, vocab_size=int(self.vocab_size or 0), max_context=self.max_context,
                          version=self.version, eos_token_ids=tuple(self.eos_token_ids or ()), kv_tokens=self.kv_tokens,
                          running_kv_tokens=self.kv_tokens,  # one pool: running requests and the radix cache
                          max_running=self.max_running)

    def __repr__(self) -> str:
        return f"SGLangEngine({self.base_url!r}, version={self.version}, live={len(self._live)})"


MAX_RUNNING_KEYS = ("effective_max_running_requests_per_dp", "max_running_requests")
"""Where ``/server_info`` reports the scheduler's running-request limit (0.5.23: the resolved one in
``internal_states``; the launch argument otherwise)."""


def _reported_size(server_info: dict, *keys: str) -> int | None:
    """The first positive integer under one of ``keys`` in ``/server_info`` or its schedulers' ``internal_states``
    (where 0.5.23 reports resolved sizes such as ``max_total_num_tokens``); None if none is reported."""
    for source in (server_info, *(server_info.get("internal_states") or [])):
        for key in keys:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


__all__ = ["SGLANG_VERSION", "SGLangEngine", "broadcast_weights", "encode_rid", "init_trainer_weight_group",
           "serialize_named_tensors", "versions_from_spans", "weight_metadata"]
