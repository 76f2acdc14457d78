"""A hand-written batched forward for Llama- and Qwen2-family causal LMs over a slot-based KV cache.

Why not HF's forward: the embedded engine needs one batched decode step over many requests of different
lengths sharing a preallocated, padded KV cache, and chunked prefill of one request into its slot. HF's
forward allocates a cache per call and its CPU continuous batching scales poorly (see DESIGN, Engines).

Weights are taken from an HF state dict (``model.layers.{i}.self_attn.q_proj.weight``, ...); q/k/v and
gate/up are fused into one matmul each. The math is HF's: RMSNorm, RoPE with ``rotate_half``, grouped-query
attention, SiLU-gated MLP, optional q/k/v biases (Qwen2), optional tied embeddings. Logits are float32.

Batch invariance: CPU GEMM kernels change their reduction order with the number of rows, and attention over
a padded batch reduces over the padded length, so a decode row's logits would depend (by ~1e-7–1e-6
relative, enough to move logprobs by >1e-5 on peaked models) on which other requests share the step. With
``batch_invariant`` on, every decode matmul runs on blocks of exactly ``INVARIANT_TILE`` rows (the batch is
zero-padded) and attention runs row by row over each row's own length, so a row's result is bit-identical
whatever the batch. ``invariant_prefill`` extends this to prefill: its matmuls use the same tiles and each
query token's attention is computed exactly as decode computes it, so a token's KV and logits are the same
bits whether it was prefilled (in any chunk), decoded or taken from the prefix cache. Without it, which
requests hit the prefix cache (a timing matter) can flip a near-tie greedy token. Off, decode uses one padded, masked attention call (faster for tiny models).

KV layout (see :class:`SlotKV`): ``k[layer]`` is ``[slots, kv_heads, max_context, head_dim]``; a request owns
one slot and its KV for positions ``[0, filled)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from rollopt.errors import ConfigError

INVARIANT_TILE = 16
"""Rows per decode matmul in batch-invariant mode (with fixed M, a row's result is independent of the rest)."""


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        if config.model_type not in ("llama", "qwen2"):
            raise ConfigError(f"model_type {config.model_type!r} is not supported; the local engine runs llama and qwen2")
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers, num_heads=heads,
            num_kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=bool(config.tie_word_embeddings),
            max_position_embeddings=config.max_position_embeddings,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of the config's RoPE, computed as HF computes them."""
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params["rope_theta"])
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv.float(), float(scaling)


class SlotKV:
    """Preallocated KV cache: ``slots`` rows of ``max_context`` positions per layer."""

    def __init__(self, shape: ModelShape, slots: int, max_context: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        size = (shape.num_layers, slots, shape.num_kv_heads, max_context, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.slots, self.max_context = slots, max_context

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions into slot ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def read(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of one slot's KV for positions ``[start, end)``: ``[layers, kv_heads, n, head_dim]``."""
        return self.k[:, slot, :, start:end].clone(), self.v[:, slot, :, start:end].clone()

    def write(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[2]
        self.k[:, slot, :, start:start + n] = k
        self.v[:, slot, :, start:start + n] = v


class LlamaModel:
    """Weights plus the two forward passes the engine needs. Not an ``nn.Module``: inference only.

    ``device`` holds the weights and runs the passes (the KV it is given must live there too); token ids and
    positions may come from the CPU, and logits are returned on ``device``."""

    def __init__(self, config, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 batch_invariant: bool = True, invariant_prefill: bool = False,
                 device: str | torch.device = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        self.invariant_prefill = invariant_prefill and batch_invariant
        self.shape = ModelShape.from_hf_config(config)
        self.dtype = dtype
        inv_freq, self.attention_scaling = rope_inv_freq(config, self.shape.head_dim)
        self._inv_freq = inv_freq.to(self.device)
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.load_state_dict(state_dict)

    # ------------------------------------------------------------------------------------------ weights
    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """(Re)load weights from an HF state dict; raises ConfigError naming a missing or mis-shaped tensor."""
        s, dt = self.shape, self.dtype

        def get(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            if name not in state_dict:
                raise ConfigError(f"weight {name!r} is missing from the state dict")
            t = state_dict[name].detach().to(self.device, dt)
            if shape is not None and tuple(t.shape) != shape:
                raise ConfigError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
            return t.contiguous()

        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.embed = get("model.embed_tokens.weight", (s.vocab_size, s.hidden_size))
        self.lm_head = self.embed if s.tie_word_embeddings or "lm_head.weight" not in state_dict else get(
            "lm_head.weight", (s.vocab_size, s.hidden_size))
        self.final_norm = get("model.norm.weight")
        self.layers = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
            if qkv.shape != (q_out + 2 * kv_out, s.hidden_size):
                raise ConfigError(f"layer {i}: fused qkv has shape {tuple(qkv.shape)}")
            bias = None
            if p + "self_attn.q_proj.bias" in state_dict:
                bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
            self.layers.append({
                "in_norm": get(p + "input_layernorm.weight"),
                "qkv": qkv, "qkv_bias": bias,
                "o": get(p + "self_attn.o_proj.weight", (s.hidden_size, q_out)),
                "post_norm": get(p + "post_attention_layernorm.weight"),
                "gate_up": torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0),
                "down": get(p + "mlp.down_proj.weight", (s.hidden_size, s.intermediate_size)),
            })

    # ------------------------------------------------------------------------------------------ pieces
    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiled: bool) -> torch.Tensor:
        tile = INVARIANT_TILE
        if not (tiled and self.batch_invariant):
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        padded = F.pad(rows, (0, 0, 0, -n % tile))
        out = torch.cat([F.linear(chunk, weight, bias) for chunk in padded.split(tile)])[:n]
        return out.view(*x.shape[:-1], weight.shape[0])

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.shape.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1
        if self._rope_cache is None or self._rope_cache[0].shape[0] < need:
            length = max(need, 2 * (self._rope_cache[0].shape[0] if self._rope_cache else 1024))
            freqs = torch.outer(torch.arange(length, dtype=torch.float32, device=self.device), self._inv_freq)
            emb = torch.cat([freqs, freqs], -1)
            self._rope_cache = (emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling)
        cos, sin = self._rope_cache
        return cos[positions].to(self.dtype), sin[positions].to(self.dtype)

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    def _qkv(self, layer: dict, h: torch.Tensor, positions: torch.Tensor, tiled: bool):
        """h: [B, n, hidden] → q [B, heads, n, d], k, v [B, kv_heads, n, d] with RoPE applied."""
        s = self.shape
        x = self._rms_norm(h, layer["in_norm"])
        qkv = self._linear(x, layer["qkv"], layer["qkv_bias"], tiled)
        B, n, _ = qkv.shape
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q = qkv[..., :q_out].view(B, n, s.num_heads, s.head_dim).transpose(1, 2)
        k = qkv[..., q_out:q_out + kv_out].view(B, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = qkv[..., q_out + kv_out:].view(B, n, s.num_kv_heads, s.head_dim).transpose(1, 2)
        cos, sin = self._rope(positions)  # [B, n, d]
        cos, sin = cos[:, None], sin[:, None]
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin), v

    def _finish_layer(self, layer: dict, h: torch.Tensor, attn: torch.Tensor, tiled: bool) -> torch.Tensor:
        B, _, n, _ = attn.shape
        h = h + self._linear(attn.transpose(1, 2).reshape(B, n, -1), layer["o"], None, tiled)
        x = self._rms_norm(h, layer["post_norm"])
        gate, up = self._linear(x, layer["gate_up"], None, tiled).chunk(2, -1)
        return h + self._linear(F.silu(gate) * up, layer["down"], None, tiled)

    def _logits(self, h: torch.Tensor, tiled: bool) -> torch.Tensor:
        return self._linear(self._rms_norm(h, self.final_norm), self.lm_head, None, tiled).float()

    # ------------------------------------------------------------------------------------------ passes
    @torch.inference_mode()
    def prefill(self, kv: SlotKV, slot: int, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Run ``tokens`` (1-D) at positions ``start..`` for one slot whose KV holds ``[0, start)``.

        Writes their KV into the slot and returns the float32 logits of the last token, ``[vocab]``.
        """
        n = tokens.shape[0]
        tokens = tokens.to(self.device)
        positions = torch.arange(start, start + n, device=self.device)[None]
        h = self.embed[tokens][None]
        tiled = self.invariant_prefill
        # query i (position start+i) attends to keys 0..start+i
        mask = torch.arange(start + n, device=self.device)[None, :] <= positions[0][:, None]
        s = self.shape
        group = s.num_heads // s.num_kv_heads
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, positions, tiled=tiled)
            kv.k[li, slot, :, start:start + n] = k[0]
            kv.v[li, slot, :, start:start + n] = v[0]
            keys = kv.k[li, slot:slot + 1, :, :start + n]
            vals = kv.v[li, slot:slot + 1, :, :start + n]
            if tiled:  # each query token exactly as decode computes it: its group folded, over its own keys
                attn = torch.empty_like(q)
                for i in range(n):
                    qg = q[:, :, i].reshape(1, s.num_kv_heads, group, s.head_dim)
                    out = F.scaled_dot_product_attention(qg, keys[:, :, :start + i + 1], vals[:, :, :start + i + 1])
                    attn[:, :, i] = out.reshape(1, s.num_heads, s.head_dim)
            else:
                attn = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=True)
            h = self._finish_layer(layer, h, attn, tiled=tiled)
        return self._logits(h[0, -1:], tiled=tiled)[0]

    @torch.inference_mode()
    def decode(self, kv: SlotKV, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One decode step for the running requests only: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` into
        slot ``slots[b]`` (distinct slots, any order), writes its KV there and attends over ``[0, positions[b]]``
        of that slot. Free and prefilling slots cost nothing. Returns float32 logits ``[len(slots), vocab]``.
        """
        B = tokens.shape[0]
        lengths = (positions + 1).tolist()
        slot_list = slots.tolist()
        tokens, positions, slots = tokens.to(self.device), positions.to(self.device), slots.to(self.device)
        s = self.shape
        group = s.num_heads // s.num_kv_heads
        if not self.batch_invariant:
            T = max(lengths)
            mask = (torch.arange(T, device=self.device)[None, :] <= positions[:, None])[:, None, None, :]
        h = self.embed[tokens][:, None]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, positions[:, None], tiled=True)
            kv.k[li, slots, :, positions] = k[:, :, 0]
            kv.v[li, slots, :, positions] = v[:, :, 0]
            # One query token per row: fold each KV head's group of query heads into the query-length axis,
            # so attention runs on the cache as it is (no GQA head repetition, no copy of K/V).
            qg = q.reshape(B, s.num_kv_heads, group, s.head_dim)
            if self.batch_invariant:  # row by row over its own length: independent of the batch
                attn = torch.empty_like(qg)
                for b, (slot, n) in enumerate(zip(slot_list, lengths)):
                    attn[b:b + 1] = F.scaled_dot_product_attention(
                        qg[b:b + 1], kv.k[li, slot:slot + 1, :, :n], kv.v[li, slot:slot + 1, :, :n])
            else:
                attn = F.scaled_dot_product_attention(qg, kv.k[li, slots, :, :T], kv.v[li, slots, :, :T], attn_mask=mask)
            attn = attn.reshape(B, s.num_heads, 1, s.head_dim)
            h = self._finish_layer(layer, h, attn, tiled=True)
        return self._logits(h[:, 0], tiled=True)
