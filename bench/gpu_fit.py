"""Fit the GPU roofline to a real GPU: the embedded engine runs a random-init model of a real shape there, and
the roofline's efficiencies are fitted to what it measures. Run it where the ``device`` tool lends a GPU.

    python bench/gpu_fit.py [--model-shape llama-3.1-8b] [--hardware auto] [--device cuda] [--repeats 3]
                            [--out bench/results]

A random-init model of ``--model-shape`` (the real sizes from its ``config.json``, bf16, made on the device: no
download) runs in the embedded engine on ``--device`` (without batch invariance: speed, not parity, is
measured). ``rollopt calibrate``'s 24 probes (batch 1–64 × prompt 16–1,024 × 8 or 48 new tokens) are timed on
it; each probe's iterations as the simulated engine plans them are priced by the roofline of ``--hardware``
(``auto``: from the device's name), first with the stated efficiencies (``DEFAULT_EFFICIENCY``), then with the
compute and memory efficiencies and the per-iteration overhead that fit the measurements best (least squares
of the relative error, scipy). Writes ``gpu-fit-<hardware>-<shape>.json`` (per probe: measured, roofline as
stated, roofline fitted; the fitted parameters and the median error of each) and
``cost-<hardware>-<shape>.json``, a cost file of the linear model fitted to the same probes, for
``--engine sim --engine-option cost_file=FILE``.

What it measures is the embedded engine, a plain torch implementation (no CUDA graphs, no FlashInfer): its
per-iteration overhead is far above SGLang's, so the fitted overhead says little about SGLang, while the
memory-bound decode probes at batch 16–64 test the roofline's bytes (weights + KV) and the long prefills its
FLOPs. On this CPU the same script runs with ``--device cpu`` (tests/test_gpu_fit.py does, on a tiny shape).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import anyio
import numpy as np
import torch
from scipy.optimize import least_squares
from transformers import LlamaConfig, Qwen2Config

from rollopt.config import LocalEngineConfig
from rollopt.engines import build_engine
from rollopt.engines.sim_calibration import DEFAULT_PROBES, EngineSizes, Probe, calibrate, planned_iterations
from rollopt.engines.sim_cost import (DEFAULT_EFFICIENCY, OVERHEAD_S, HARDWARE, Hardware, IterationFeatures,
                                      ModelShape, RooflineCost, hardware, model_shape)
from rollopt.errors import ConfigError
from rollopt.modeling import LoadedModel


def hf_config(shape: ModelShape, max_context: int) -> Any:
    """The HF config of ``shape`` (Qwen2 where q/k/v carry a bias, else Llama)."""
    cls = Qwen2Config if shape.qkv_bias else LlamaConfig
    return cls(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
               num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
               head_dim=shape.head_dim, max_position_embeddings=max_context, tie_word_embeddings=shape.tie_embeddings,
               rope_theta=500000.0, eos_token_id=None)


def random_state_dict(shape: ModelShape, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights of ``shape`` in bf16, made on ``device`` (std 0.02, norms 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(*size: int) -> torch.Tensor:
        return (torch.randn(size, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=torch.bfloat16)

    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    weights = {"model.embed_tokens.weight": w(shape.vocab, shape.hidden), "model.norm.weight": ones(shape.hidden)}
    if not shape.tie_embeddings:
        weights["lm_head.weight"] = w(shape.vocab, shape.hidden)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        weights.update({p + "self_attn.q_proj.weight": w(q, shape.hidden), p + "self_attn.k_proj.weight": w(kv, shape.hidden),
                        p + "self_attn.v_proj.weight": w(kv, shape.hidden), p + "self_attn.o_proj.weight": w(shape.hidden, q),
                        p + "mlp.gate_proj.weight": w(shape.intermediate, shape.hidden),
                        p + "mlp.up_proj.weight": w(shape.intermediate, shape.hidden),
                        p + "mlp.down_proj.weight": w(shape.hidden, shape.intermediate),
                        p + "input_layernorm.weight": ones(shape.hidden),
                        p + "post_attention_layernorm.weight": ones(shape.hidden)})
        if shape.qkv_bias:
            weights.update({p + f"self_attn.{n}_proj.bias": w(size) for n, size in (("q", q), ("k", kv), ("v", kv))})
    return weights


def detect_hardware(device: str) -> Hardware:
    """The roofline's GPU for ``device``, from the name CUDA reports."""
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    for key in ("H200", "H100", "A100"):
        if key in name:
            return hardware(key if key != "A100" else "A100-80GB-SXM")
    raise ConfigError(f"no roofline for device {name!r}; pass --hardware ({', '.join(sorted({h.name for h in HARDWARE.values()}))})")


def roofline_s(plans: Sequence[list[IterationFeatures]], hw: Hardware, shape: ModelShape,
               compute_eff: float, memory_eff: float, overhead_s: float) -> np.ndarray:
    """Each probe's seconds as the roofline prices its planned iterations."""
    cost = RooflineCost(hw, shape, efficiency=(compute_eff, memory_eff), overhead_s=overhead_s)
    return np.array([sum(cost.seconds(f) for f in plan) for plan in plans])


def fit_roofline(plans: Sequence[list[IterationFeatures]], measured: np.ndarray, hw: Hardware,
                 shape: ModelShape) -> tuple[float, float, float]:
    """(compute efficiency, memory efficiency, overhead s) minimising the probes' squared relative errors."""
    def residuals(x: np.ndarray) -> np.ndarray:
        return roofline_s(plans, hw, shape, *np.exp(x[:2]), np.exp(x[2])) / measured - 1

    start = np.log([*DEFAULT_EFFICIENCY, OVERHEAD_S])
    fit = least_squares(residuals, start, bounds=(np.log([1e-6, 1e-6, 1e-7]), np.log([1.0, 1.0, 10.0])))
    compute_eff, memory_eff, overhead_s = np.exp(fit.x)
    return float(compute_eff), float(memory_eff), float(overhead_s)


async def measure(shape: ModelShape, hw: Hardware, device: str, repeats: int, probes: Sequence[Probe],
                  max_running: int = 64, max_context: int = 2048, progress: Any = print) -> dict[str, Any]:
    """Time ``probes`` on the embedded engine running ``shape`` on ``device``; the report (see the module)."""
    config = LocalEngineConfig(max_running=max_running, max_context=max_context, prefill_chunk=2048,
                               prefix_cache_tokens=0, kv_budget_mb=1e9, dtype="bfloat16", batch_invariant=False,
                               device=device)
    sizes = EngineSizes.of(config)
    began = time.perf_counter()
    model = LoadedModel(hf_config(shape, max_context), random_state_dict(shape, device), None,
                        f"random-init {shape.name}")
    async with build_engine(config, model) as engine:
        fit = await calibrate(engine, sizes, f"local {shape.name} on {device}", probes=probes, repeats=repeats,
                              progress=progress)
    planned = await anyio.to_thread.run_sync(planned_iterations, [p.probe for p in fit.probes], sizes, shape.vocab)
    plans = [planned[p.probe] for p in fit.probes]
    measured = np.array([p.median_s for p in fit.probes])
    stated = roofline_s(plans, hw, shape, *DEFAULT_EFFICIENCY, OVERHEAD_S)
    fitted_params = fit_roofline(plans, measured, hw, shape)
    fitted = roofline_s(plans, hw, shape, *fitted_params)

    def median_error(predicted: np.ndarray) -> float:
        return float(statistics.median(np.abs(predicted / measured - 1)))

    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
    return {"hardware": hw.name, "device": device_name, "model_shape": shape.name, "engine": "local (embedded, bf16)",
            "sizes": {"max_running": max_running, "max_context": max_context, "prefill_chunk": config.prefill_chunk},
            "repeats": repeats, "wall_s": time.perf_counter() - began, "machine": fit.machine,
            "stated": {"compute_eff": DEFAULT_EFFICIENCY[0], "memory_eff": DEFAULT_EFFICIENCY[1],
                       "overhead_s": OVERHEAD_S, "median_rel_error": median_error(stated)},
            "fitted": {"compute_eff": fitted_params[0], "memory_eff": fitted_params[1],
                       "overhead_s": fitted_params[2], "median_rel_error": median_error(fitted)},
            "probes": [{"batch": p.probe.batch, "prompt_tokens": p.probe.prompt_tokens, "new_tokens": p.probe.new_tokens,
                        "iterations": p.iterations, "measured_s": list(p.measured_s), "median_s": p.median_s,
                        "roofline_stated_s": float(s), "roofline_fitted_s": float(f), "linear_fitted_s": p.fitted_s}
                       for p, s, f in zip(fit.probes, stated, fitted)],
            "_cost_fit": fit}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-shape", default="llama-3.1-8b")
    parser.add_argument("--hardware", default="auto")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here: run it where a GPU is lent (the device tool), or pass --device cpu")
    shape = model_shape(args.model_shape)
    hw = detect_hardware(args.device) if args.hardware == "auto" else hardware(args.hardware)
    report = anyio.run(measure, shape, hw, args.device, args.repeats, DEFAULT_PROBES)
    cost_fit = report.pop("_cost_fit")
    stem = f"{hw.name}-{shape.name}".lower()
    cost_fit.save(args.out / f"cost-{stem}.json")
    (args.out / f"gpu-fit-{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("hardware", "device", "model_shape", "stated", "fitted", "wall_s")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
