"""Scheduler overhead at 256 concurrent trajectories, as a fraction of engine time.

    .venv/bin/python bench/scheduler_overhead.py [--trajectories 256] [--repeats 3]

The same seeded synthetic workload (instant tools) runs twice per policy and repeat:

1. on the scripted engine, which emits its tokens at no cost: the wall time is the executor's and policy's
   own cost (gates, views, graph, token bookkeeping) plus the scripted engine's bookkeeping, an upper bound
   of the scheduling overhead;
2. on the embedded engine with the tiny model: its ``busy_s`` is the engine time of that workload.

overhead = wall(scripted) / busy_s(embedded). Medians and min–max over interleaved repeats; writes
``bench/results/scheduler_overhead.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import anyio
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from rollopt import ChatRenderer, LocalEngine, LocalEngineConfig, RolloutExecutor, SamplingParams  # noqa: E402
from rollopt import ScriptedEngine, episode_specs  # noqa: E402
from rollopt.environments import SyntheticEnv  # noqa: E402
from rollopt.modeling import load_model  # noqa: E402

POLICIES = ("sync", "overlap", "overlap+prefix+preempt")


def workload(n: int):
    env = SyntheticEnv(turns=(2, 4), tokens_per_turn=(8, 24), tools_per_turn=1, tool_latency_s=0.0, tool_sigma=0.0)
    return env, episode_specs(env.tasks(n // 4, 0), 4, SamplingParams(temperature=1.0), seed=0)


async def scripted_wall(env, specs, renderer, policy: str, vocab: int) -> float:
    engine = ScriptedEngine(lambda req: [5 + (i % 50) for i in range(req.sampling.max_new_tokens)], vocab_size=vocab,
                            count_cached_tokens=False)  # the engine's own bookkeeping is not the scheduler's
    started = time.perf_counter()
    await RolloutExecutor(env, engine, renderer, policy).run(specs)
    return time.perf_counter() - started


async def engine_busy(env, specs, renderer, policy: str, model) -> float:
    engine = LocalEngine(model.config, model.state_dict, LocalEngineConfig(max_running=256, max_context=1024,
                                                                           prefix_cache_tokens=65536, threads=1))
    async with engine:
        await RolloutExecutor(env, engine, renderer, policy).run(specs)
    return engine.stats.busy_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = load_model("tiny")
    renderer = ChatRenderer(model.tokenizer)
    env, specs = workload(args.trajectories)
    gc.freeze()  # the startup heap (torch, transformers, the model) is not rescanned by every full collection
    raw: dict[str, dict[str, list[float]]] = {p: {"scripted_wall_s": [], "engine_busy_s": []} for p in POLICIES}
    for rep in range(args.repeats):
        for policy in POLICIES:
            raw[policy]["scripted_wall_s"].append(anyio.run(scripted_wall, env, specs, renderer, policy, len(model.tokenizer)))
            raw[policy]["engine_busy_s"].append(anyio.run(engine_busy, env, specs, renderer, policy, model))
            print(f"repeat {rep + 1} {policy}: scripted {raw[policy]['scripted_wall_s'][-1]:.2f} s, "
                  f"engine busy {raw[policy]['engine_busy_s'][-1]:.2f} s", flush=True)
    results = {}
    for policy, r in raw.items():
        ratios = [a / b for a, b in zip(r["scripted_wall_s"], r["engine_busy_s"])]
        results[policy] = {**r, "overhead_frac": statistics.median(ratios), "overhead_min": min(ratios),
                           "overhead_max": max(ratios)}
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "scheduler_overhead", "trajectories": args.trajectories, "repeats": args.repeats,
              "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}, "results": results}
    (args.out / "scheduler_overhead.json").write_text(json.dumps(report, indent=2))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    meds = [results[p]["overhead_frac"] * 100 for p in POLICIES]
    err = [[m - results[p]["overhead_min"] * 100 for m, p in zip(meds, POLICIES)],
           [results[p]["overhead_max"] * 100 - m for m, p in zip(meds, POLICIES)]]
    ax.bar(POLICIES, meds, yerr=err, capsize=4, color="#4477aa")
    ax.axhline(5, color="red", ls="--", lw=0.8, label="5% target")
    ax.set_ylabel("scheduler overhead, % of engine time")
    ax.set_title(f"{args.trajectories} concurrent trajectories")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "scheduler_overhead.png", dpi=110)
    for p in POLICIES:
        print(f"{p}: overhead {results[p]['overhead_frac']:.1%} "
              f"[{results[p]['overhead_min']:.1%}-{results[p]['overhead_max']:.1%}] of engine time")


if __name__ == "__main__":
    main()
