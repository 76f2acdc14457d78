"""Embedded-engine throughput: decode tokens/s vs batch size, prefix-hit time-to-first-token, and the same
requests through sequential HF ``generate`` as the baseline, side by side in one run.

    .venv/bin/python bench/engine_throughput.py [--repeats 3] [--shapes tiny,smollm2] [--out bench/results]

Shapes are random-init (speed does not depend on the weights): ``tiny`` (hidden 64, 2 layers) and ``smollm2``
(SmolLM2-135M-Instruct's shape: 30 layers, hidden 576, 9/3 heads, vocab 49152). Requests share a 432-token
prefix plus 16 tokens of their own and decode 64 tokens greedily with ``ignore_eos``, so decode runs at a
context of 448–512. Decode tok/s = tokens from decode steps / time in decode steps (the engine's counters).
Repeats are interleaved across configurations so machine drift spreads evenly; medians and min–max are
reported. Writes ``engine_throughput.json`` and ``engine_throughput.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import anyio
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from rollopt import GenerateRequest, LocalEngineConfig, SamplingParams  # noqa: E402
from rollopt.engines import build_engine  # noqa: E402
from rollopt.modeling import LoadedModel  # noqa: E402
from rollopt.modeling.tiny import build_model  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512),
    "smollm2": dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                    vocab_size=49152, tie_word_embeddings=True),
}
PREFIX, OWN, NEW = 432, 16, 64
BATCHES = (1, 8, 32)


def tokens(n: int, seed: int, vocab: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


async def decode_throughput(engine: LocalEngine, batch: int, vocab: int, seed: int) -> float:
    prefix = tokens(PREFIX, seed, vocab)
    sampling = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    await engine.generate(GenerateRequest(f"warm{seed}.{batch}", prefix + tokens(OWN, -1, vocab), sampling))
    before_tokens, before_s = engine.stats.decode_tokens, engine.stats.decode_s
    async with anyio.create_task_group() as tg:
        for i in range(batch):
            tg.start_soon(engine.generate, GenerateRequest(f"b{seed}.{batch}.{i}", prefix + tokens(OWN, 1000 + i, vocab),
                                                           sampling))
    return (engine.stats.decode_tokens - before_tokens) / (engine.stats.decode_s - before_s)


async def ttft(engine: LocalEngine, vocab: int, seed: int) -> tuple[float, float]:
    """(cold, prefix-hit) time to first token for a 480-token prompt; the hit shares 480 tokens with the cold one."""
    await engine.flush_cache()
    prefix = tokens(480, 77 + seed, vocab)
    sampling = SamplingParams(max_new_tokens=1, temperature=0)

    async def first_token(ids) -> float:
        started = time.perf_counter()
        async for _ in engine.stream(GenerateRequest(f"t{seed}.{time.perf_counter_ns()}", ids, sampling)):
            return time.perf_counter() - started
        raise AssertionError("no chunk")

    cold = await first_token(prefix + (5,))
    hit = await first_token(prefix + (6,))
    return cold, hit


def hf_sequential(model, batch: int, vocab: int, seed: int) -> float:
    prefix = tokens(PREFIX, seed, vocab)
    started, produced = time.perf_counter(), 0
    for i in range(batch):
        ids = torch.tensor([prefix + tokens(OWN, 1000 + i, vocab)])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        produced += out.shape[1] - ids.shape[1]
    return produced / (time.perf_counter() - started)


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def run_shape(name: str, repeats: int, hf_batch: int) -> dict:
    shape = dict(SHAPES[name])
    vocab = shape.pop("vocab_size")
    model = build_model(vocab, max_position_embeddings=2048, **shape)
    state = model.state_dict()
    raw: dict[str, list[float]] = {}

    async def engine_part(invariant: bool, rep: int) -> None:
        cfg = LocalEngineConfig(max_running=32, max_context=1024, prefix_cache_tokens=4096,
                                batch_invariant=invariant, kv_budget_mb=8192)
        async with build_engine(cfg, LoadedModel(model.config, state, None, name)) as engine:
            for b in BATCHES:
                raw.setdefault(f"decode_tok_s.invariant={invariant}.batch={b}", []).append(
                    await decode_throughput(engine, b, vocab, rep))
            if invariant:
                cold, hit = await ttft(engine, vocab, rep)
                raw.setdefault("ttft_cold_s", []).append(cold)
                raw.setdefault("ttft_hit_s", []).append(hit)

    for rep in range(repeats):  # interleaved: A B C, A B C, ...
        for invariant in (True, False):
            anyio.run(engine_part, invariant, rep)
        raw.setdefault(f"hf_generate_tok_s.batch={hf_batch}", []).append(hf_sequential(model, hf_batch, vocab, rep))
        print(f"[{name}] repeat {rep + 1}/{repeats} done", flush=True)
    out = {k: spread(v) for k, v in raw.items()}
    med = lambda k: out[k]["median"]  # noqa: E731
    for inv in (True, False):
        out[f"scaling_32_vs_1.invariant={inv}"] = med(f"decode_tok_s.invariant={inv}.batch=32") / med(
            f"decode_tok_s.invariant={inv}.batch=1")
    out["ttft_speedup"] = med("ttft_cold_s") / med("ttft_hit_s")
    return out


def plot(results: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        for inv, style in ((True, "o-"), (False, "s--")):
            meds = [res[f"decode_tok_s.invariant={inv}.batch={b}"]["median"] for b in BATCHES]
            lo = [res[f"decode_tok_s.invariant={inv}.batch={b}"]["min"] for b in BATCHES]
            hi = [res[f"decode_tok_s.invariant={inv}.batch={b}"]["max"] for b in BATCHES]
            ax.errorbar(BATCHES, meds, yerr=[[m - a for m, a in zip(meds, lo)], [b - m for m, b in zip(meds, hi)]],
                        fmt=style, capsize=3, label=f"rollopt local, batch_invariant={inv}")
        hf_key = next(k for k in res if k.startswith("hf_generate"))
        ax.axhline(res[hf_key]["median"], color="gray", ls=":", label="HF generate, sequential")
        ax.set_xscale("log", base=2)
        ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{name}: TTFT 480-token prefix hit {res['ttft_speedup']:.0f}x faster than cold")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default="tiny,smollm2")
    parser.add_argument("--hf-batch", type=int, default=4, help="requests for the sequential HF baseline")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    results = {name: run_shape(name, args.repeats, args.hf_batch) for name in args.shapes.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "engine_throughput",
        "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "cpu": platform.processor(),
                    "torch": torch.__version__},
        "workload": {"prefix_tokens": PREFIX, "own_tokens": OWN, "new_tokens": NEW, "dtype": "float32"},
        "repeats": args.repeats,
        "results": results,
    }
    (args.out / "engine_throughput.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "engine_throughput.png")
    for name, res in results.items():
        print(f"{name}: " + ", ".join(
            f"b{b} {res[f'decode_tok_s.invariant=True.batch={b}']['median']:.0f} tok/s" for b in BATCHES)
              + f"; 32 vs 1: {res['scaling_32_vs_1.invariant=True']:.1f}x (invariant) "
              f"{res['scaling_32_vs_1.invariant=False']:.1f}x (off); TTFT hit {res['ttft_speedup']:.1f}x; "
              + ", ".join(f"{k} {v['median']:.0f}" for k, v in res.items() if k.startswith("hf_generate")))


if __name__ == "__main__":
    main()
