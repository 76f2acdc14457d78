"""Scheduler overhead at 64 and 256 concurrent trajectories, as a fraction of engine time.

    .venv/bin/python bench/scheduler_overhead.py [--trajectories 64,256] [--shapes short,long] [--repeats 3]

Each configuration (turn shape × trajectories) is one seeded synthetic workload with instant tools. It runs
twice per policy and repeat, repeats interleaved:

1. on the scripted engine, which emits its tokens at no cost (one token per chunk, one scheduling point per
   token, as a streaming engine delivers them; no prefix bookkeeping): the wall time is what the executor and
   the policy cost (gates, views, graph, token bookkeeping, chat rendering, tool dispatch) plus the scripted
   engine's own chunk loop, an upper bound of the scheduling overhead;
2. on the embedded engine with the tiny model: its ``busy_s`` is the engine time of that workload.

overhead = wall(scripted) / busy_s(embedded); medians and min–max of the per-repeat ratios. Rendering the
chat (prompts and observation deltas through the chat template and the tokenizer) is timed on its own and
also reported left out, since any rollout loop pays it. For context it
also reports how much of the embedded run's wall time its engine sat idle (tools are instant, so idle time is
the executor's: its work runs on the event loop while a forward pass runs in the engine's worker thread). The overhead has
a cost per turn (render the observation, append and check the spans, move the trajectory through its
stages, run the tool call) and a smaller cost per streamed token, so it is reported per turn as well, and
the same turns are run short (8–24 tokens, like ``tool-heavy``) and long (64–192 tokens, a tool call with
some reasoning). The startup heap is frozen first, as the CLI does (a full collection would rescan it), and
the previous run's garbage is collected before each timed run.
Writes ``scheduler_overhead.json`` and ``.png`` under ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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
SHAPES = {"short": (8, 24), "long": (64, 192)}  # generated tokens per turn, (min, max)


class TimedRenderer(ChatRenderer):
    """A :class:`ChatRenderer` that adds up the seconds spent rendering prompts and observations (the chat
    template and the tokenizer: work any rollout loop does, whatever its scheduler)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.seconds = 0.0

    @contextmanager
    def _timed(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started

    def prompt(self, messages, tools=None):
        with self._timed():
            return super().prompt(messages, tools)

    def observation(self, messages, last_generated_id):
        with self._timed():
            return super().observation(messages, last_generated_id)


def workload(n: int, tokens_per_turn: tuple[int, int] = SHAPES["short"]):
    env = SyntheticEnv(turns=(2, 4), tokens_per_turn=tokens_per_turn, tools_per_turn=1, tool_latency_s=0.0,
                       tool_sigma=0.0)
    return env, episode_specs(env.tasks(n // 4, 0), 4, SamplingParams(temperature=1.0), seed=0)


async def scripted_wall(env, specs, renderer: TimedRenderer, policy: str, vocab: int) -> tuple[float, float, int, int]:
    """Wall seconds of the batch on the scripted engine, the part of them spent rendering chat, and the batch's
    turns and generated tokens."""
    engine = ScriptedEngine(lambda req: [5 + (i % 50) for i in range(req.sampling.max_new_tokens)], vocab_size=vocab,
                            count_cached_tokens=False)  # the engine's own bookkeeping is not the scheduler's
    rendering_before, started = renderer.seconds, time.perf_counter()
    result = await RolloutExecutor(env, engine, renderer, policy).run(specs)
    wall = time.perf_counter() - started
    return (wall, renderer.seconds - rendering_before, sum(len(t.turns) for t in result.trajectories),
            sum(t.num_generated for t in result.trajectories))


async def engine_busy(env, specs, renderer, policy: str, model) -> tuple[float, float]:
    """The embedded engine's busy seconds for the batch, and the batch's wall seconds."""
    engine = LocalEngine(model.config, model.state_dict, LocalEngineConfig(max_running=256, max_context=2048,
                                                                           prefix_cache_tokens=65536, threads=1))
    async with engine:
        started = time.perf_counter()
        await RolloutExecutor(env, engine, renderer, policy).run(specs)
        wall = time.perf_counter() - started
    return engine.stats.busy_s, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", default="64,256", help="comma-separated concurrency levels")
    parser.add_argument("--shapes", default="short,long", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = load_model("tiny")
    renderer = TimedRenderer(model.tokenizer)
    configs = [(shape, int(n)) for shape in args.shapes.split(",") for n in args.trajectories.split(",")]
    loads = {c: workload(c[1], SHAPES[c[0]]) for c in configs}
    gc.collect()
    gc.freeze()  # the startup heap (torch, transformers, the model) is not rescanned by every full collection
    raw = {(c, p): {"scripted_wall_s": [], "rendering_s": [], "engine_busy_s": [], "engine_wall_s": []}
           for c in configs for p in POLICIES}
    for rep in range(args.repeats):
        for c in configs:
            env, specs = loads[c]
            for policy in POLICIES:
                r = raw[(c, policy)]
                gc.collect()  # the previous run's garbage is not this run's cost
                wall, rendering, r["turns"], r["tokens"] = anyio.run(scripted_wall, env, specs, renderer, policy,
                                                                     len(model.tokenizer))
                r["scripted_wall_s"].append(wall)
                r["rendering_s"].append(rendering)
                gc.collect()
                busy, engine_wall = anyio.run(engine_busy, env, specs, renderer, policy, model)
                r["engine_busy_s"].append(busy)
                r["engine_wall_s"].append(engine_wall)
                print(f"repeat {rep + 1} {c[0]} × {c[1]} {policy}: scripted {wall:.3f} s, "
                      f"engine busy {r['engine_busy_s'][-1]:.2f} s", flush=True)
    rows = []
    for (c, policy), r in raw.items():
        ratios = [a / b for a, b in zip(r["scripted_wall_s"], r["engine_busy_s"])]
        without_rendering = [(a - x) / b for a, x, b in zip(r["scripted_wall_s"], r["rendering_s"], r["engine_busy_s"])]
        rows.append({"shape": c[0], "tokens_per_turn": SHAPES[c[0]], "trajectories": c[1], "scheduler": policy,
                     **r, "overhead_frac": statistics.median(ratios), "overhead_min": min(ratios),
                     "overhead_max": max(ratios), "overhead_without_rendering_frac": statistics.median(without_rendering),
                     "scheduler_us_per_turn": statistics.median(r["scripted_wall_s"]) / r["turns"] * 1e6,
                     "engine_idle_frac": statistics.median(1 - b / w for b, w in zip(r["engine_busy_s"],
                                                                                     r["engine_wall_s"])),
                     "engine_us_per_turn": statistics.median(r["engine_busy_s"]) / r["turns"] * 1e6})
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "scheduler_overhead", "repeats": args.repeats, "model": "tiny-llama",
              "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}, "results": rows}
    (args.out / "scheduler_overhead.json").write_text(json.dumps(report, indent=2))
    plot(rows, configs, args.out / "scheduler_overhead.png")
    for row in rows:
        print(f"{row['shape']:>5} × {row['trajectories']:>3} {row['scheduler']:>22}: overhead "
              f"{row['overhead_frac']:.1%} [{row['overhead_min']:.1%}-{row['overhead_max']:.1%}] of engine time "
              f"({row['overhead_without_rendering_frac']:.1%} without chat rendering); "
              f"{row['scheduler_us_per_turn']:.0f} µs per turn against {row['engine_us_per_turn']:.0f} µs of engine; "
              f"embedded run: engine idle {row['engine_idle_frac']:.1%} of its wall time")


def plot(rows: list[dict], configs: list[tuple[str, int]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(POLICIES)
    for k, policy in enumerate(POLICIES):
        mine = [next(r for r in rows if (r["shape"], r["trajectories"]) == c and r["scheduler"] == policy)
                for c in configs]
        meds = [r["overhead_frac"] * 100 for r in mine]
        err = [[m - r["overhead_min"] * 100 for m, r in zip(meds, mine)],
               [r["overhead_max"] * 100 - m for m, r in zip(meds, mine)]]
        ax.bar([i + (k - 1) * width for i in range(len(configs))], meds, width, yerr=err, capsize=3, label=policy)
    ax.axhline(5, color="red", ls="--", lw=0.8, label="5% target")
    ax.set_xticks(range(len(configs)),
                  [f"{s} turns ({SHAPES[s][0]}-{SHAPES[s][1]} tok)\n{n} trajectories" for s, n in configs])
    ax.set_ylabel("scheduler overhead, % of engine time")
    ax.set_title("executor + policy on the scripted engine ÷ tiny-model engine time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
