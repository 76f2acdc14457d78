"""Cost models of the simulated engine: the seconds one engine iteration takes, from what the iteration does.

An iteration (one scheduler step of a continuous-batching engine) is summarized by :class:`IterationFeatures`:
prefill tokens and their attention work, the decode batch and the KV it reads. A cost model maps that to
seconds:

* :class:`LinearCost` — ``fixed + a·prefill_tokens + b·decode_seqs + c·decode_kv_read``, fitted by non-negative
  least squares (:meth:`LinearCost.fit`) to iterations measured on a real engine (the Vidur method: profile
  once, then simulate). Its ``name`` says what it was fitted to.
* :class:`RooflineCost` — a GPU roofline: ``max(FLOPs / (peak × compute efficiency), bytes / (HBM bandwidth ×
  memory efficiency)) + all-reduce + overhead``. A **projection**: nothing here was measured on that GPU
  running that model, and its ``name`` says so.

The tables: :data:`HARDWARE` (published specs) and :data:`MODEL_SHAPES` (HF ``config.json`` values). Unknown
names are one-line :class:`~rollopt.errors.ConfigError` s listing the known ones. No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from rollopt.errors import ConfigError

BF16_BYTES = 2


@dataclass(frozen=True)
class IterationFeatures:
    """What one iteration computes. ``prefill_attention``: query·key pairs of the prefill chunks (a chunk of
    ``n`` tokens after ``p`` cached ones attends ``n·p + n(n+1)/2``); ``prefill_kv_read``: KV tokens of earlier
    context the chunks read; ``decode_kv_read``: the context lengths of the decode rows, summed (each row reads
    its whole KV); ``logit_rows``: rows that compute logits and sample (decode rows + finished prefills)."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention: int = 0
    prefill_kv_read: int = 0
    decode_seqs: int = 0
    decode_kv_read: int = 0
    logit_rows: int = 0


class CostModel(Protocol):
    name: str

    def seconds(self, f: IterationFeatures) -> float: ...


# ------------------------------------------------------------------------------------------------ tables
@dataclass(frozen=True)
class Hardware:
    """One GPU: dense bf16 tensor FLOP/s (no sparsity), HBM bandwidth, memory as the driver reports it (MiB,
    what SGLang sizes its KV pool from), NVLink bandwidth per direction (bytes/s)."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    memory_mib: int
    nvlink_bytes_per_s: float
    source: str


HARDWARE: dict[str, Hardware] = {h.name.lower(): h for h in (
    Hardware("H100-SXM", 989e12, 3.35e12, 81559, 450e9,
             "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB, "
             "NVLink 900 GB/s bidirectional); notes/agentic-scale.md"),
    Hardware("H200", 989e12, 4.8e12, 143771, 450e9,
             "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, 141 GB, "
             "NVLink 900 GB/s bidirectional); notes/agentic-scale.md"),
    Hardware("A100-80GB-SXM", 312e12, 2.039e12, 81920, 300e9,
             "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM: 312 TFLOP/s dense BF16, 2,039 GB/s HBM2e, "
             "NVLink 600 GB/s bidirectional)"),
)}
HARDWARE["h100"] = HARDWARE["h100-sxm"]

DEFAULT_EFFICIENCY = (0.80, 0.90)
"""(compute, memory) efficiency of the roofline: the fractions of peak this workplace measured on its H200
(notes/agentic-scale.md: an 8192³ bf16 matmul at ~790 of 989 TFLOP/s = 0.80; a device copy at ~4.3 of
4.8 TB/s = 0.90). Best-case kernel figures, applied to every GPU: a real engine's attention and small-batch
GEMMs reach less, so the roofline tends to under-estimate iteration time."""

OVERHEAD_S = 1e-3
"""Per-iteration scheduling and launch overhead of the roofline: an assumption (not measured here) for an
engine that replays CUDA graphs for decode."""

ALLREDUCE_LATENCY_S = 10e-6
"""Latency of one tensor-parallel all-reduce over NVLink: an assumption (not measured here), the order of
NCCL's small-message latency within one node."""


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder's shape, from its HF ``config.json``."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = False
    qkv_bias: bool = False

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention + SwiGLU MLP + two norms)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def params(self) -> int:
        """Every parameter (embedding, layers, final norm, and the LM head unless tied)."""
        embed = self.vocab * self.hidden
        return self.layers * self.layer_params + embed * (1 if self.tie_embeddings else 2) + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters read by every forward pass: the layers and the LM head (the embedding is only gathered)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of every layer for one token on one of ``tp`` GPUs (KV heads split, replicated below one)."""
        return 2 * self.layers * math.ceil(self.kv_heads / tp) * self.head_dim * BF16_BYTES

    @classmethod
    def from_hf_config(cls, config: Any, name: str | None = None) -> "ModelShape":
        heads = config.num_attention_heads
        return cls(name or getattr(config, "name_or_path", "") or "model", config.num_hidden_layers,
                   config.hidden_size, heads, getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size,
                   config.vocab_size, bool(getattr(config, "tie_word_embeddings", False)),
                   bool(getattr(config, "attention_bias", False)) or getattr(config, "model_type", "") == "qwen2")


MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    # meta-llama/*/config.json
    ModelShape("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, tie_embeddings=True),
    ModelShape("llama-3.1-8b", 32, 4096, 32, 8, 128, 14336, 128256),
    ModelShape("llama-3.1-70b", 80, 8192, 64, 8, 128, 28672, 128256),
    # Qwen/Qwen2.5-*/config.json (q/k/v projections carry a bias)
    ModelShape("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, tie_embeddings=True, qkv_bias=True),
    ModelShape("qwen2.5-1.5b", 28, 1536, 12, 2, 128, 8960, 151936, tie_embeddings=True, qkv_bias=True),
    ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True),
    ModelShape("qwen2.5-32b", 64, 5120, 40, 8, 128, 27648, 152064, qkv_bias=True),
    ModelShape("qwen2.5-72b", 80, 8192, 64, 8, 128, 29568, 152064, qkv_bias=True),
)}


def hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join(sorted({h.name for h in HARDWARE.values()}))}"
                          ) from None


def model_shape(name: str) -> ModelShape:
    try:
        return MODEL_SHAPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}") from None


def sglang_mem_fraction(hw: Hardware, prefill_chunk: int, tp: int = 1) -> float:
    """SGLang 0.5.23's default ``--mem-fraction-static`` (``arg_groups/memory_hook.py``): the memory left after
    reserving ``512 + 1.5·max(chunk, 2048) + 1024·tp/8 + 2·decode-graph max_bs`` MiB (at least 10 GiB on a
    GPU over 60 GiB) for activations and CUDA graphs; the prefill-graph term is left out."""
    max_bs = 256 if tp < 4 else 512
    reserved = 512 + 1.5 * max(prefill_chunk, 2048) + tp / 8 * 1024 + 2 * max_bs
    if hw.memory_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((hw.memory_mib - reserved) / hw.memory_mib, 3)


def kv_capacity_tokens(hw: Hardware, shape: ModelShape, tp: int, mem_fraction: float) -> int:
    """KV tokens the pool holds: (memory × mem_fraction − weights) / KV bytes per token, per GPU of ``tp``."""
    budget = hw.memory_mib * 2**20 * mem_fraction
    weights = shape.params * BF16_BYTES / tp
    if weights >= budget:
        raise ConfigError(f"{shape.name} weights ({weights / 1e9:.1f} GB per GPU at tp={tp}) do not fit "
                          f"{hw.name} × mem_fraction {mem_fraction:g} ({budget / 1e9:.1f} GB); raise tp")
    return int((budget - weights) // shape.kv_bytes_per_token(tp))


# ------------------------------------------------------------------------------------------------ models
@dataclass(frozen=True)
class LinearCost:
    """``fixed_s + per_prefill_token_s·prefill_tokens + per_decode_seq_s·decode_seqs
    + per_kv_token_s·decode_kv_read + per_attention_pair_s·prefill_attention + per_prefill_seq_s·prefill_seqs``.

    ``per_attention_pair_s`` prices prefill attention (query·key pairs, quadratic in a chunk's context): fit it
    on prompts as long as the ones simulated before trusting it at 16–64k tokens. ``per_prefill_seq_s`` is what
    each request in a prefill adds (the embedded engine runs one forward pass per prefilling request)."""

    fixed_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_kv_token_s: float
    per_attention_pair_s: float = 0.0
    per_prefill_seq_s: float = 0.0
    name: str = "linear"

    def seconds(self, f: IterationFeatures) -> float:
        return (self.fixed_s + self.per_prefill_token_s * f.prefill_tokens + self.per_decode_seq_s * f.decode_seqs
                + self.per_kv_token_s * f.decode_kv_read + self.per_attention_pair_s * f.prefill_attention
                + self.per_prefill_seq_s * f.prefill_seqs)

    @property
    def coefficients(self) -> tuple[float, ...]:
        """In the order of the constructor (and of ``SimEngineConfig.linear``)."""
        return (self.fixed_s, self.per_prefill_token_s, self.per_decode_seq_s, self.per_kv_token_s,
                self.per_attention_pair_s, self.per_prefill_seq_s)

    @classmethod
    def fit(cls, samples: Sequence[tuple[IterationFeatures | Sequence[IterationFeatures], float]],
            label: str) -> "LinearCost":
        """Non-negative least squares (``scipy.optimize.nnls``) of the relative error over measured
        ``(iterations, seconds)``: one iteration and its time, or a run of iterations (a calibration probe) and
        the run's total time, which the model prices as the sum of its iterations (linear in the
        coefficients). Relative, so that short probes (the per-iteration cost) weigh as much as long ones. The
        name records the label, the sample count and the root-mean-square error."""
        import numpy as np
        from scipy.optimize import nnls

        if len(samples) < 6:
            raise ConfigError(f"LinearCost.fit needs at least 6 measured samples (one per coefficient), "
                              f"got {len(samples)}")
        runs = [[f] if isinstance(f, IterationFeatures) else list(f) for f, _ in samples]
        x = np.array([[len(run), sum(f.prefill_tokens for f in run), sum(f.decode_seqs for f in run),
                       sum(f.decode_kv_read for f in run), sum(f.prefill_attention for f in run),
                       sum(f.prefill_seqs for f in run)] for run in runs], dtype=float)
        y = np.array([s for _, s in samples], dtype=float)
        if not (y > 0).all():
            raise ConfigError("LinearCost.fit: every measured time must be > 0")
        coef, _ = nnls(x / y[:, None], np.ones_like(y))  # relative errors: a 10 ms probe counts as a 1 s one
        rmse = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
        what = "iterations" if all(len(run) == 1 for run in runs) else "probes"
        return cls(*map(float, coef), name=f"fitted:{label} (linear, {len(samples)} {what}, "
                                             f"rmse {rmse * 1e3:.3g} ms)")


class RooflineCost:
    """A GPU roofline of one iteration (a projection).

    FLOPs = 2·(layer params)·(prefill + decode tokens) + 2·(LM head)·logit rows + 4·layers·heads·head_dim·(query·key
    pairs: prefill attention + decode KV read). Bytes = the layer weights and LM head (read once per iteration) + KV
    read (earlier context of prefill chunks, every decode row's context) + KV written (one per prefill and decode
    token), at ``kv_bytes_per_token``. Time = max(FLOPs / (peak × compute eff.), bytes / (HBM × memory eff.)) per
    GPU, both divided by ``tp`` (KV heads split; replicated when fewer than ``tp``), plus for tp > 1 two ring
    all-reduces per layer of the iteration's activations (``2(tp−1)/tp × tokens × hidden × 2 B`` over NVLink per
    direction + :data:`ALLREDUCE_LATENCY_S` each), plus ``overhead_s``. ``efficiency``: one factor for both, or
    (compute, memory); default :data:`DEFAULT_EFFICIENCY`.
    """

    def __init__(self, hardware_name: str | Hardware, shape: str | ModelShape, tp: int = 1,
                 efficiency: float | tuple[float, float] | None = None, overhead_s: float = OVERHEAD_S) -> None:
        self.hw = hardware_name if isinstance(hardware_name, Hardware) else hardware(hardware_name)
        self.shape = shape if isinstance(shape, ModelShape) else model_shape(shape)
        if tp < 1:
            raise ConfigError(f"tp must be >= 1, got {tp}")
        eff = DEFAULT_EFFICIENCY if efficiency is None else efficiency
        self.compute_eff, self.memory_eff = (eff, eff) if isinstance(eff, (int, float)) else eff
        if not (0 < self.compute_eff <= 1 and 0 < self.memory_eff <= 1):
            raise ConfigError(f"roofline efficiency must be in (0, 1], got {eff!r}")
        self.tp, self.overhead_s = tp, overhead_s
        s = self.shape
        self._layer_flops = 2.0 * s.layers * s.layer_params
        self._head_flops = 2.0 * s.vocab * s.hidden
        self._attn_flops = 4.0 * s.layers * s.heads * s.head_dim
        self._weight_bytes = float(s.matmul_params * BF16_BYTES) / tp
        self._kv_bytes = float(s.kv_bytes_per_token(tp))
        self._flops_per_s = self.hw.bf16_flops * self.compute_eff
        self._bytes_per_s = self.hw.hbm_bytes_per_s * self.memory_eff
        self.name = f"roofline:{self.hw.name}:{s.name}:tp{tp} (projection)"

    def flops(self, f: IterationFeatures) -> float:
        tokens = f.prefill_tokens + f.decode_seqs
        return (self._layer_flops * tokens + self._head_flops * f.logit_rows
                + self._attn_flops * (f.prefill_attention + f.decode_kv_read))

    def bytes(self, f: IterationFeatures) -> float:
        """Bytes moved on one GPU."""
        kv_tokens = f.prefill_kv_read + f.decode_kv_read + f.prefill_tokens + f.decode_seqs
        return self._weight_bytes + self._kv_bytes * kv_tokens

    def allreduce_s(self, f: IterationFeatures) -> float:
        if self.tp == 1:
            return 0.0
        tokens = f.prefill_tokens + f.decode_seqs
        size = tokens * self.shape.hidden * BF16_BYTES * 2 * (self.tp - 1) / self.tp
        return 2 * self.shape.layers * (ALLREDUCE_LATENCY_S + size / self.hw.nvlink_bytes_per_s)

    def seconds(self, f: IterationFeatures) -> float:
        compute = self.flops(f) / self.tp / self._flops_per_s
        memory = self.bytes(f) / self._bytes_per_s
        return max(compute, memory) + self.allreduce_s(f) + self.overhead_s


def resolve(config: Any, shape: ModelShape | None) -> tuple[CostModel, int]:
    """The cost model and KV pool size (tokens) of a :class:`~rollopt.config.SimEngineConfig` for ``shape``;
    a one-line ConfigError when the pool cannot hold one ``max_context`` request."""
    hw = hardware(config.hardware)
    if config.linear:
        cost: CostModel = LinearCost(*config.linear, name=f"fitted:{config.fitted_to} (linear)")
    else:
        if shape is None:
            raise ConfigError("the roofline cost model needs a model shape: set engine.model_shape")
        cost = RooflineCost(hw, shape, config.tp, tuple(config.efficiency))
    kv = config.kv_tokens
    where = f"engine.kv_tokens={kv}"
    if kv is None:
        assert shape is not None
        fraction = config.mem_fraction or sglang_mem_fraction(hw, config.prefill_chunk, config.tp)
        kv = kv_capacity_tokens(hw, shape, config.tp, fraction)
        where = f"{shape.name} on {hw.name} at tp={config.tp}, mem_fraction {fraction:g}"
    if kv < config.max_context:
        raise ConfigError(f"the KV pool ({kv} tokens: {where}) cannot hold one max_context={config.max_context} "
                          "request; lower engine.max_context, or raise engine.kv_tokens / engine.tp / "
                          "engine.mem_fraction")
    return cost, kv
