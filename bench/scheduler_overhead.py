"""Scheduler overhead at 64 and 256 concurrent trajectories, as a fraction of engine time.

    .venv/bin/python bench/scheduler_overhead.py [--trajectories 64,256] [--shapes short,long] [--repeats 3]
                                                 [--scripted-runs 5]

Each configuration (turn shape × trajectories) is one seeded synthetic workload with instant tools, run three
ways in each repeat (repeats interleaved, so the VM's drift cancels in the per-repeat ratios):

1. **executor on the scripted engine**, per policy: the engine emits its tokens at no cost (streamed as the
   request's ``stream_tokens`` asks; no prefix bookkeeping), so the wall time is the rollout's own work: the
   executor and the policy (gates, snapshots, graph, stages) plus the work any rollout loop does (chat
   rendering, token records, tool dispatch, the environment's hooks) plus the scripted engine's few lines;
2. **a bare loop on the scripted engine** (``bare_loop``): one task per episode that streams, appends the
   tokens with logprobs and versions, parses, runs the tool calls, steps the environment and renders the
   observation, with no policy, gates, snapshots, graph or turn records. It must produce the executor's exact
   tokens (checked before timing), so it did the same work;
3. **executor on the embedded engine** with the tiny model, per policy: its ``busy_s`` is the engine time.

Each repeat's scripted figures are medians of ``--scripted-runs`` interleaved runs (they take 0.05–0.5 s).
Reported, as medians and min–max of the per-repeat ratios to ``busy_s``:

* ``overhead_frac``: the whole rollout on the scripted engine, an upper bound of what the scheduler costs;
  also without chat rendering (prompts and observation deltas: template + tokenizer, timed on their own);
* ``bare_loop_frac``: the bare loop, the floor any loop pays for this workload;
* ``scheduler_added_frac``: ``(executor wall - bare loop wall) / busy_s``, what the scheduler adds.

Also per turn (the cost is per turn: render the observation, record the spans, move through the stages, run
the tool call), for short turns (8–24 tokens, like ``tool-heavy``) and long ones (64–192 tokens, a tool call
with some reasoning), and how much of the embedded run's wall time its engine sat idle (tools are instant,
so idle time is the executor's: its work runs on the event loop while a forward pass runs in the engine's
worker thread). Each configuration runs once untimed first (first-call costs such as compiling the chat
template come once per process, not per batch). The startup heap is then frozen, as the CLI does (a full
collection would rescan it), and the previous run's garbage is collected before each timed run.
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

from rollopt import ChatRenderer, LocalEngineConfig, RolloutExecutor, SamplingParams  # noqa: E402
from rollopt.engines import build_engine  # noqa: E402
from rollopt import ScriptedEngine, TokenSpan, Trajectory, episode_specs, execute_tool_call  # noqa: E402
from rollopt.engines.base import GenerateRequest  # noqa: E402
from rollopt.toolcalls import parse_tool_calls  # noqa: E402
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


def scripted_engine(vocab: int) -> ScriptedEngine:
    return ScriptedEngine(lambda req: [5 + (i % 50) for i in range(req.sampling.max_new_tokens)], vocab_size=vocab,
                          count_cached_tokens=False)  # the engine's own bookkeeping is not the scheduler's


async def scripted_wall(env, specs, renderer: TimedRenderer, policy: str,
                        vocab: int) -> tuple[float, float, list[Trajectory]]:
    """Wall seconds of the batch on the scripted engine, the part of them spent rendering chat, and the
    batch's trajectories."""
    engine = scripted_engine(vocab)
    rendering_before, started = renderer.seconds, time.perf_counter()
    result = await RolloutExecutor(env, engine, renderer, policy).run(specs)
    wall = time.perf_counter() - started
    return wall, renderer.seconds - rendering_before, result.trajectories


async def bare_loop(env, specs, renderer: ChatRenderer, vocab: int) -> tuple[float, dict[str, list[int]]]:
    """The same batch driven by the loop a user would write without a scheduler: one task per episode that
    renders its prompt (once per group), streams each turn from the scripted engine, appends the tokens with
    their logprobs and versions, parses the turn, runs its tool calls, steps the environment and appends the
    observation. No policy, gates, snapshots, graph or turn records. Returns its wall seconds and every
    trajectory's tokens (which must equal the executor's: the same work was done)."""
    engine, tools, schemas = scripted_engine(vocab), env.tools(), env.prompt_tool_schemas()
    prompts: dict[str, TokenSpan] = {}
    tokens: dict[str, list[int]] = {}

    async def episode(spec) -> None:
        if spec.group_id not in prompts:
            prompts[spec.group_id] = TokenSpan.prompt(renderer.prompt(env.reset(spec.task), schemas))
        traj = Trajectory.start(spec.trajectory_id, spec.task.id, spec.group_id, prompts[spec.group_id])
        for turn in range(env.max_turns):
            request = GenerateRequest(f"{traj.id}.t{turn}", tuple(traj.token_ids.tolist()),
                                      env.turn_sampling(spec.task, turn, spec.sampling), stream_tokens=frozenset())
            ids, logprobs, versions = [], [], []
            async for chunk in engine.stream(request):
                ids += chunk.token_ids
                logprobs += chunk.logprobs
                versions += chunk.versions
            traj.append(TokenSpan.generated(ids, logprobs, versions))
            parsed = parse_tool_calls(renderer.decode(ids))
            results = [await execute_tool_call(tools, call) for call in env.calls_for_turn(spec.task, turn, parsed)]
            outcome = env.step(spec.task, turn, parsed, results)
            if outcome.done:
                break
            traj.append(TokenSpan.observation(renderer.observation(outcome.observation, ids[-1])))
        tokens[traj.id] = traj.token_ids.tolist()

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for spec in specs:
            tg.start_soon(episode, spec)
    return time.perf_counter() - started, tokens


async def engine_busy(env, specs, renderer, policy: str, model) -> tuple[float, float]:
    """The embedded engine's busy seconds for the batch, and the batch's wall seconds."""
    config = LocalEngineConfig(max_running=256, prefix_cache_tokens=65536, threads=1)
    async with build_engine(config, model) as engine:
        started = time.perf_counter()
        await RolloutExecutor(env, engine, renderer, policy).run(specs)
        wall = time.perf_counter() - started
    return engine.stats.busy_s, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", default="64,256", help="comma-separated concurrency levels")
    parser.add_argument("--shapes", default="short,long", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scripted-runs", type=int, default=5,
                        help="scripted and bare-loop runs per repeat (their medians are the repeat's figures)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    model = load_model("tiny")
    renderer = TimedRenderer(model.tokenizer)
    configs = [(shape, int(n)) for shape in args.shapes.split(",") for n in args.trajectories.split(",")]
    loads = {c: workload(c[1], SHAPES[c[0]]) for c in configs}
    vocab = len(model.tokenizer)
    for c in configs:  # discarded warm-up: first-call costs (template compile, caches, kernels) come once per run
        env, specs = loads[c]
        bare_tokens = anyio.run(bare_loop, env, specs, renderer, vocab)[1]
        for policy in POLICIES:
            trajectories = anyio.run(scripted_wall, env, specs, renderer, policy, vocab)[2]
            if {t.id: t.token_ids.tolist() for t in trajectories} != bare_tokens:
                raise AssertionError(f"{c} {policy}: the bare loop and the executor did different work")
        anyio.run(engine_busy, env, specs, renderer, POLICIES[0], model)
    renderer.seconds = 0.0
    gc.collect()
    gc.freeze()  # the startup heap (torch, transformers, the model) is not rescanned by every full collection
    raw = {(c, p): {"scripted_wall_s": [], "bare_loop_wall_s": [], "rendering_s": [], "engine_busy_s": [],
                    "engine_wall_s": []} for c in configs for p in POLICIES}
    for rep in range(args.repeats):
        for c in configs:
            env, specs = loads[c]
            runs: dict[str, list] = {name: [] for name in ("bare", *POLICIES)}
            for _ in range(args.scripted_runs):  # cheap runs, interleaved: their medians are the repeat's figures
                gc.collect()  # the previous run's garbage is not this run's cost
                runs["bare"].append(anyio.run(bare_loop, env, specs, renderer, vocab)[0])
                for policy in POLICIES:
                    gc.collect()
                    wall, rendering, trajectories = anyio.run(scripted_wall, env, specs, renderer, policy, vocab)
                    r = raw[(c, policy)]
                    r["turns"] = sum(len(t.turns) for t in trajectories)
                    r["tokens"] = sum(t.num_generated for t in trajectories)
                    runs[policy].append((wall, rendering))  # not the trajectories: no batch outlives its run
                    del trajectories
            for policy in POLICIES:
                r = raw[(c, policy)]
                r["bare_loop_wall_s"].append(statistics.median(runs["bare"]))
                r["scripted_wall_s"].append(statistics.median(w for w, _ in runs[policy]))
                r["rendering_s"].append(statistics.median(x for _, x in runs[policy]))
                gc.collect()
                busy, engine_wall = anyio.run(engine_busy, env, specs, renderer, policy, model)
                r["engine_busy_s"].append(busy)
                r["engine_wall_s"].append(engine_wall)
                print(f"repeat {rep + 1} {c[0]} × {c[1]} {policy}: scripted {r['scripted_wall_s'][-1]:.3f} s "
                      f"(bare loop {r['bare_loop_wall_s'][-1]:.3f} s), engine busy {busy:.2f} s", flush=True)
    rows = []
    for (c, policy), r in raw.items():
        ratios = [a / b for a, b in zip(r["scripted_wall_s"], r["engine_busy_s"])]
        without_rendering = [(a - x) / b for a, x, b in zip(r["scripted_wall_s"], r["rendering_s"], r["engine_busy_s"])]
        floor = [a / b for a, b in zip(r["bare_loop_wall_s"], r["engine_busy_s"])]
        added = [(a - x) / b for a, x, b in zip(r["scripted_wall_s"], r["bare_loop_wall_s"], r["engine_busy_s"])]
        rows.append({"shape": c[0], "tokens_per_turn": SHAPES[c[0]], "trajectories": c[1], "scheduler": policy,
                     **r, "overhead_frac": statistics.median(ratios), "overhead_min": min(ratios),
                     "overhead_max": max(ratios), "overhead_without_rendering_frac": statistics.median(without_rendering),
                     "bare_loop_frac": statistics.median(floor), "scheduler_added_frac": statistics.median(added),
                     "scheduler_added_min": min(added), "scheduler_added_max": max(added),
                     "scheduler_us_per_turn": statistics.median(r["scripted_wall_s"]) / r["turns"] * 1e6,
                     "engine_idle_frac": statistics.median(1 - b / w for b, w in zip(r["engine_busy_s"],
                                                                                     r["engine_wall_s"])),
                     "engine_us_per_turn": statistics.median(r["engine_busy_s"]) / r["turns"] * 1e6})
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "scheduler_overhead", "repeats": args.repeats, "scripted_runs": args.scripted_runs,
              "model": "tiny-llama",
              "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads()}, "results": rows}
    (args.out / "scheduler_overhead.json").write_text(json.dumps(report, indent=2))
    plot(rows, configs, args.out / "scheduler_overhead.png")
    for row in rows:
        print(f"{row['shape']:>5} × {row['trajectories']:>3} {row['scheduler']:>22}: overhead "
              f"{row['overhead_frac']:.1%} [{row['overhead_min']:.1%}-{row['overhead_max']:.1%}] of engine time "
              f"({row['overhead_without_rendering_frac']:.1%} without chat rendering; a bare loop doing the same "
              f"work {row['bare_loop_frac']:.1%}, so the scheduler adds {row['scheduler_added_frac']:.1%} "
              f"[{row['scheduler_added_min']:.1%}-{row['scheduler_added_max']:.1%}]); "
              f"{row['scheduler_us_per_turn']:.0f} µs per turn against {row['engine_us_per_turn']:.0f} µs of engine; "
              f"embedded run: engine idle {row['engine_idle_frac']:.1%} of its wall time")


def plot(rows: list[dict], configs: list[tuple[str, int]], path: Path) -> None:
    """Left: the whole rollout on the scripted engine (hatched: the bare loop's share). Right: what the scheduler
    adds over the bare loop, against the 5% target."""
    fig, (whole, added) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    width = 0.8 / len(POLICIES)
    labels = [f"{s} turns ({SHAPES[s][0]}-{SHAPES[s][1]} tok)\n{n} trajectories" for s, n in configs]
    for k, policy in enumerate(POLICIES):
        mine = [next(r for r in rows if (r["shape"], r["trajectories"]) == c and r["scheduler"] == policy)
                for c in configs]
        xs = [i + (k - 1) * width for i in range(len(configs))]
        for ax, key in ((whole, "overhead"), (added, "scheduler_added")):
            meds = [r[f"{key}_frac"] * 100 for r in mine]
            err = [[m - r[f"{key}_min"] * 100 for m, r in zip(meds, mine)],
                   [r[f"{key}_max"] * 100 - m for m, r in zip(meds, mine)]]
            ax.bar(xs, meds, width, yerr=err, capsize=3, color=f"C{k}", label=policy)
        whole.bar(xs, [r["bare_loop_frac"] * 100 for r in mine], width, color="none", edgecolor="black", hatch="//",
                  lw=0, label="bare loop, same work" if k == 0 else None)
    for ax in (whole, added):
        ax.axhline(5, color="red", ls="--", lw=0.8, label="5% target")
        ax.set_xticks(range(len(configs)), labels, fontsize=8)
    whole.set_ylabel("% of the tiny model's engine time")
    whole.set_title("whole rollout on the scripted engine\n(hatched: a bare loop doing the same work)", fontsize=10)
    added.set_title("what the scheduler adds: (rollout - bare loop)", fontsize=10)
    whole.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
