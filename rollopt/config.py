"""One typed configuration for what the commands build: engines (a tagged union, open to plug-ins), checked
on construction, importable without torch.

Each engine's configuration is a frozen dataclass with a ``kind`` tag (the engine's registered name, see
:mod:`rollopt.engines`) and a docstring per field. Values are type-checked on construction by pydantic's
``TypeAdapter`` against the field's annotation (pydantic is already installed with transformers, is well kept,
and says what it expected; hand-written ``isinstance`` checks would miss ``tuple[str, ...]`` or ``int | None``),
and a wrong one is a one-line :class:`~rollopt.errors.ConfigError` naming the key, the value and the type.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from rollopt.errors import BadRequestError, ConfigError


def parse_value(text: str) -> Any:
    """A ``key=value`` option's value: as TOML (``3``, ``0.5``, ``true``, ``"text"``, ``[1, 2]``), else the text
    itself (a bare word such as ``never``). Recipe overrides, engine and environment options, and scheduler options in
    brackets all read values this way."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


@functools.cache
def _adapter(hint: Any):
    from pydantic import TypeAdapter

    return TypeAdapter(hint)


def check_value(key: str, value: Any, hint: Any) -> Any:
    """``value`` checked against the annotation ``hint`` in pydantic's strict mode (no "3" for 3, no true for
    1.0; an int is a float, a TOML array a tuple), or a ConfigError that names ``key``, the value and the type."""
    from pydantic import ValidationError

    if isinstance(value, list) and "tuple" in str(hint):  # TOML has arrays, the configs keep tuples
        value = tuple(value)
    try:
        return _adapter(hint).validate_python(value, strict=True)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"]
        expected = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
        raise ConfigError(f"{key} = {value!r}: expected {expected} ({reason})") from None


def check_fields(obj: Any, prefix: str = "") -> None:
    """Type-check every field of the dataclass instance ``obj`` (see :func:`check_value`); converted values
    (a list given for a tuple) are written back."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        checked = check_value(prefix + f.name, value, hints[f.name])
        if checked is not value and checked != value or type(checked) is not type(value):
            object.__setattr__(obj, f.name, checked)


@dataclass(frozen=True)
class LocalEngineConfig:
    """The embedded engine (``rollopt.engines.local``, registered as ``local``) and its sizing.

    Attributes:
        max_running: KV slots, i.e. the largest decode batch; more requests wait in the queue.
        max_context: positions per slot; prompt + max_new_tokens of a request must fit.
        prefill_chunk: prompt tokens prefilled per tick (long prompts are split across ticks).
        block_size: prefix-cache block size in tokens.
        prefix_cache_tokens: prefix-cache capacity in tokens (0 disables the cache).
        kv_budget_mb: refuse to start if slots + prefix cache would need more KV memory than this.
        dtype: "float32" or "bfloat16".
        batch_invariant: a request's tokens and logprobs do not depend on which other requests share its
            decode steps (fixed-size matmul tiles, per-row attention; see rollopt.modeling.llama). Off is
            faster for tiny models; R1 token parity between schedulers relies on it being on.
        invariant_prefill: prefill with decode's kernels too (16-row tiles, per-token attention), so KV does not
            depend on how a prefix was computed (chunk, decode, cache hit) and greedy output does not depend on
            the timing of cache hits. Exact R1 parity across schedulers needs it; prefill is several times slower.
        seed: seeds requests that give no seed of their own (request n gets ``seed + n``).
        defer_shared_prefill: admit a request whose first uncached block a request still prefilling computes
            only after that prefill, so it reuses the KV (like SGLang's in-batch prefix caching).
        threads: intra-op threads of the forward passes (None: torch's setting). Set for each tick and restored
            after it, so a trainer in the same process keeps its own. With few cores, fewer engine threads leave a
            core to the event loop (executor, tools, streaming): on this 2-core machine a tick in the worker
            thread ran 2.4× faster with 1 thread than with 2 for the tiny model at batch 1, and no slower for
            the 135M shape at batch 1 or 32.
        device: where the weights, the KV and the forward passes live (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
            Sampling runs on the CPU from the logits either way, so a seed gives the same draw on any device.
    """

    kind: ClassVar[str] = "local"
    max_running: int = 32
    max_context: int = 2048
    prefill_chunk: int = 512
    block_size: int = 16
    prefix_cache_tokens: int = 16384
    kv_budget_mb: float = 4096
    dtype: str = "float32"
    batch_invariant: bool = True
    invariant_prefill: bool = False
    seed: int = 0
    defer_shared_prefill: bool = True
    threads: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_fields(self, "engine.")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"engine.dtype = {self.dtype!r}: use 'float32' or 'bfloat16'")
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"engine.device = {self.device!r}: use 'cpu', 'cuda' or 'cuda:N'")

    def validate(self, kv_bytes_per_token: int) -> None:
        """Sizes against the model's KV bytes per token (called by the engine once the model is known)."""
        for name in ("max_running", "max_context", "prefill_chunk", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or None (torch's default), got {self.threads}")
        need = (self.max_running * self.max_context + self.prefix_cache_tokens) * kv_bytes_per_token / 2**20
        if need > self.kv_budget_mb:
            raise ConfigError(
                f"KV cache needs {need:.0f} MB (max_running={self.max_running} × max_context={self.max_context} "
                f"+ prefix_cache_tokens={self.prefix_cache_tokens}, {kv_bytes_per_token} B/token) but "
                f"kv_budget_mb={self.kv_budget_mb:g}; lower max_running, max_context or prefix_cache_tokens, "
                "or raise kv_budget_mb"
            )


@dataclass(frozen=True)
class SGLangEngineConfig:
    """A real SGLang server (sglang==0.5.23 from ``.venv-sglang``) started for the run's weights, registered as
    ``sglang``; stopped when the command ends."""

    kind: ClassVar[str] = "sglang"
    device: str = "cpu"
    """The server's ``--device`` ("cuda" on a GPU machine)."""
    args: tuple[str, ...] = ("--dtype", "float32")
    """More ``sglang.launch_server`` flags."""
    python: str | None = None
    """The interpreter of the SGLang venv (None: ``.venv-sglang/bin/python`` of the checkout)."""
    incremental_stream: bool = True
    """Start the server with ``--incremental-streaming-output`` (chunks hold only new tokens; SGLang's default
    resends all earlier ones in every chunk: O(n²) work on long answers)."""

    def __post_init__(self) -> None:
        check_fields(self, "engine.")


@dataclass(frozen=True)
class ServersEngineConfig:
    """SGLang servers that are already running, routed group-affine by ``RoutedEngine``; registered as
    ``servers``."""

    kind: ClassVar[str] = "servers"
    urls: tuple[str, ...] = ()
    """Base URLs, e.g. ``("http://infer0:30000", "http://infer1:30000")``."""

    def __post_init__(self) -> None:
        check_fields(self, "engine.")
        if not self.urls:
            raise ConfigError('engine "servers" needs its urls: rollout.servers = ["http://host:port", ...]')


EngineConfig = LocalEngineConfig | SGLangEngineConfig | ServersEngineConfig  # | SimEngineConfig (defined below)
"""The shipped engines' configurations; a plug-in engine brings its own class (any frozen dataclass with a
``kind``), see :func:`rollopt.engines.register_engine`."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, with SGLang's field names and conventions.

    ``max_new_tokens == 0`` only prefills the prompt (it lands in the prefix cache; nothing is sampled).
    ``temperature == 0`` is greedy. ``top_k == -1`` and ``top_p == 1`` disable those filters. ``stop`` strings
    and ``stop_token_ids`` end the request with ``finish_reason == "stop"`` (the stop token is kept in the
    output, as SGLang does). ``seed`` makes sampling reproducible per request.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def validate(self) -> None:
        problems = []
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            problems.append(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (self.top_k == -1 or self.top_k >= 1):
            problems.append(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if problems:
            raise BadRequestError("invalid sampling params: " + "; ".join(problems))

    def to_sglang(self) -> dict[str, Any]:
        """SGLang's ``sampling_params`` dict (``sglang/srt/sampling/sampling_params.py`` names)."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "ignore_eos": self.ignore_eos,
        }
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out


@dataclass(frozen=True)
class SimEngineConfig:
    """The simulated engine (``rollopt.engines.sim``, registered as ``sim``): SGLang's scheduling and KV mechanics
    on a virtual clock, each iteration timed by a cost model (a GPU roofline, a projection, or a linear fit to a
    measured engine; see :mod:`rollopt.engines.sim_cost`)."""

    kind: ClassVar[str] = "sim"
    virtual_clock: ClassVar[bool] = True  # run under trio's MockClock: iterations and tool waits take no wall time
    scripted: ClassVar[bool] = True  # runs no model: a script decides each request's tokens (EngineContext.script)
    hardware: str = "H200"
    """GPU of the roofline and of the KV pool size (a name of ``sim_cost.HARDWARE``)."""
    model_shape: str | None = None
    """A shape of ``sim_cost.MODEL_SHAPES`` (e.g. "llama-3.1-8b"); None: the loaded model's HF config."""
    tp: int = 1
    """Tensor-parallel GPUs of the engine (weights, KV heads and FLOPs split; an all-reduce cost added)."""
    mem_fraction: float | None = None
    """Share of GPU memory for weights + KV pool (SGLang's --mem-fraction-static); None: SGLang's default."""
    kv_tokens: int | None = None
    """KV pool capacity in tokens; None: (memory × mem_fraction − weights) / KV bytes per token."""
    linear: tuple[float, ...] = ()
    """(fixed_s, per_prefill_token_s, per_decode_seq_s, per_kv_token_s[, per_attention_pair_s,
    per_prefill_seq_s]) of a fitted LinearCost; empty: roofline."""
    fitted_to: str = ""
    """What ``linear`` was fitted to (printed in the cost model's name); required with ``linear``."""
    cost_file: str | None = None
    """A cost file written by ``rollopt calibrate`` (:mod:`rollopt.engines.sim_calibration`): sets ``linear``
    and ``fitted_to``, ``kv_tokens`` unless given, and the calibrated engine's ``max_running``,
    ``prefill_chunk``, ``block_size``, ``max_context``, ``defer_shared_prefill`` and ``mixed_prefill`` where these
    are left at their defaults, so the sim replays the engine it was fitted to."""
    efficiency: tuple[float, float] = (0.80, 0.90)
    """Roofline (compute, memory) fractions of peak (measured H200 figures, notes/agentic-scale.md)."""
    max_running: int = 256
    """Most requests running at once (SGLang's --max-running-requests); more wait in the queue."""
    max_context: int = 32768
    """Positions per request: prompt + max_new_tokens must fit."""
    prefill_chunk: int = 8192
    """Prefill tokens per iteration across requests (SGLang's --chunked-prefill-size on H100/H200)."""
    block_size: int = 16
    """KV page size in tokens (the prefix cache matches whole pages)."""
    defer_shared_prefill: bool = True
    """Admit a request whose first uncached page another request is prefilling after that prefill (the embedded
    engine; SGLang's cache-aware schedule policies do alike); False: prefill it again in the same batch (SGLang
    0.5.23's default ``--schedule-policy fcfs``)."""
    mixed_prefill: bool = True
    """An iteration decodes every running request and prefills up to ``prefill_chunk`` tokens besides (a mixed
    batch: the embedded engine, SGLang with ``--enable-mixed-chunk``); False: an iteration with prefill work does
    only that, and the running requests decode in the next iteration without new prefill (SGLang 0.5.23's
    default: "run prefill first if possible")."""
    filler_token: int | None = None
    """Token the default script emits (max_new_tokens of them: every request writes the same text, so histories
    share KV as no sampled model's do); None: ids of ``rollopt.engines.sim.sampled_text``, distinct per request."""
    logprob: float = -1.0
    """The logprob reported for every token."""
    servers: int = 1
    """Simulated servers, each with this configuration, behind the real ``RoutedEngine`` (group-affine routing)."""
    rebalance: bool = True
    """With several servers, let the router move a group off an overloaded server (``AffinityRouter``'s
    ``rebalance_abs``/``rebalance_rel`` defaults); False: a group stays where it first landed."""

    def __post_init__(self) -> None:
        check_fields(self, "engine.")
        if self.cost_file is not None:
            self._apply_cost_file()
        for name in ("tp", "max_running", "max_context", "prefill_chunk", "block_size", "servers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise ConfigError(f"engine.mem_fraction must be in (0, 1] or None (SGLang's default), "
                              f"got {self.mem_fraction}")
        if self.kv_tokens is not None and self.kv_tokens < self.block_size:
            raise ConfigError(f"engine.kv_tokens must hold one block ({self.block_size} tokens), got {self.kv_tokens}")
        if self.linear and (not 4 <= len(self.linear) <= 6 or min(self.linear) < 0):
            raise ConfigError(f"engine.linear = {self.linear!r}: give 4 to 6 coefficients >= 0 "
                              "(fixed_s, per_prefill_token_s, per_decode_seq_s, per_kv_token_s[, "
                              "per_attention_pair_s, per_prefill_seq_s])")
        if self.linear and not self.fitted_to:
            raise ConfigError("engine.linear needs engine.fitted_to naming what it was fitted to, "
                              'e.g. "local-cpu tiny"')
        if self.linear and self.kv_tokens is None:
            raise ConfigError("engine.linear needs engine.kv_tokens (the KV pool of the engine it was fitted to)")
        if not all(0 < e <= 1 for e in self.efficiency):
            raise ConfigError(f"engine.efficiency = {self.efficiency!r}: (compute, memory) fractions in (0, 1]")
        if self.filler_token is not None and self.filler_token < 0:
            raise ConfigError(f"engine.filler_token must be a token id >= 0, got {self.filler_token}")
        from rollopt.engines import sim_cost  # lazily: names and sizes are checked now, not when the engine opens

        sim_cost.hardware(self.hardware)
        if self.model_shape is not None or self.linear:
            sim_cost.resolve(self, sim_cost.model_shape(self.model_shape) if self.model_shape else None)
        elif self.kv_tokens is not None and self.kv_tokens < self.max_context:
            raise ConfigError(f"the KV pool (engine.kv_tokens={self.kv_tokens}) cannot hold one max_context="
                              f"{self.max_context} request; lower engine.max_context or raise engine.kv_tokens")

    def _apply_cost_file(self) -> None:
        """Fill the fields ``cost_file`` sets (see its docstring); frozen, hence ``object.__setattr__``."""
        from rollopt.engines.sim_calibration import load_cost_file

        if self.linear:
            raise ConfigError("give engine.cost_file or engine.linear, not both")
        loaded = load_cost_file(self.cost_file)
        values = {"linear": loaded.linear, "fitted_to": loaded.fitted_to}
        if self.kv_tokens is None:
            values["kv_tokens"] = loaded.sizes.kv_tokens
        for f in dataclasses.fields(self):
            if f.name in ("max_running", "prefill_chunk", "block_size", "max_context", "defer_shared_prefill",
                          "mixed_prefill") and \
                    getattr(self, f.name) == f.default:
                values[f.name] = getattr(loaded.sizes, f.name)
        for name, value in values.items():
            object.__setattr__(self, name, value)
