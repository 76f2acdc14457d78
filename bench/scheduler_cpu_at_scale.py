"""The scheduler's own CPU cost per turn at thousands of trajectories, against the simulated engine's time.

    .venv/bin/python bench/scheduler_cpu_at_scale.py [--workload swe-agent] [--trajectories 1024,2048,4096]
                                                     [--servers 8] [--scheduler auto] [--out bench/results]

On the simulated engine (virtual clock) the engine costs no wall time, so this process's CPU is the rollout's own:
the executor, the policy, the chat renderer and tokenizer, the environment, the simulated engine's bookkeeping and
the event loop. Each size runs one seeded step under ``cProfile`` (a deterministic profiler: it sees every call),
and each function's *own* time (``tottime``, so nothing is counted twice) is charged to one part:

* ``policy``: every function of the policy package (``schedulers/``: the gates, admission, priorities, pins, the
  ``RolloutView`` snapshot and its O(1) tallies);
* ``executor gates``: the executor's side of scheduling (``_notify``, ``_wake_gate_waiters``, ``view``,
  ``_wait_to_generate``, ``_wait_until``): what a state change costs besides the policy;
* ``sim engine``: the simulated engine, its cost model and the router (the instrument, not rollopt's overhead);
* ``event loop``: trio and anyio; ``rest``: everything else (executor, rendering, tokenizer, environment, graph).

The profiler slows every call by a similar factor, so the *shares* are what it measures well; the per-turn
milliseconds are shares times this run's profiled CPU time and overstate the unprofiled cost (the agentic bench's
``wall_s_per_run`` gives the unprofiled whole-process figure). "O(1) per state change" shows as the scheduler's
milliseconds per turn staying flat as the trajectories grow 4×. The simulated engine time per turn is the servers'
summed busy seconds over the turns: the GPU time the CPU cost is set against. Writes
``scheduler-cpu-<workload>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

import anyio

from rollopt import ChatRenderer, RolloutExecutor, episode_specs
from rollopt.benchmark.runner import engine_config
from rollopt.benchmark.workloads import get_workload
from rollopt.engines import EngineContext, build_engine
from rollopt.engines import run as run_on_engine_clock
from rollopt.engines.virtual_clock import start_repeatable_run
from rollopt.modeling import load_model
from rollopt.schedulers import build_scheduler

EXECUTOR_GATES = {"_notify", "_wake_gate_waiters", "view", "_wait_to_generate", "_wait_until"}


def part_of(filename: str, function: str) -> str:
    """Which part a function's own time is charged to (see the module docstring)."""
    path = filename.replace("\\", "/")
    if "/schedulers/" in path:
        return "policy"
    if path.endswith("rollopt/executor.py") and function in EXECUTOR_GATES:
        return "executor gates"
    if any(path.endswith(f"rollopt/engines/{m}.py") for m in ("sim", "sim_cost", "routed", "routing", "base")):
        return "sim engine"
    if "/trio/" in path or "/anyio/" in path or "/outcome/" in path:
        return "event loop"
    return "rest"


def profile_step(workload_name: str, trajectories: int, servers: int, scheduler: str) -> dict[str, float]:
    probe = get_workload(workload_name)
    workload = get_workload(workload_name, tasks=trajectories // probe.group_size)
    config = engine_config("sim", workload, servers=servers, max_running=workload.max_running)
    model = load_model(workload.model, seed=0)
    env = workload.make_env()
    script = env.simulated_model(model.tokenizer)
    out: dict[str, float] = {}
    top: dict[str, float] = {}  # the scheduler's costliest functions, own seconds

    async def step() -> None:
        async with build_engine(config, model, EngineContext(script=script)) as engine:
            specs = episode_specs(env.tasks(workload.tasks, 0), workload.group_size, workload.sampling, 0)
            await start_repeatable_run(0)  # trio's order of same-instant wake-ups seeded: the step repeats exactly
            executor = RolloutExecutor(env, engine, ChatRenderer(model.tokenizer), build_scheduler(scheduler),
                                       clock=anyio.current_time)
            profiler = cProfile.Profile()
            cpu0 = time.process_time()
            profiler.enable()
            result = await executor.run(specs)
            profiler.disable()
            out["profiled_cpu_s"] = time.process_time() - cpu0
            members = getattr(engine, "engines", [engine])
            out["engine_busy_s"] = sum(e.stats.busy_s for e in members)
            out["makespan_s"] = result.wall_s
            out["turns"] = sum(len(t.turns) for t in result.trajectories)
            parts: dict[str, float] = {}
            scheduling: dict[str, float] = {}
            for (filename, line, function), (_, calls, tottime, _, _) in pstats.Stats(profiler).stats.items():
                key = part_of(filename, function)
                parts[key] = parts.get(key, 0.0) + tottime
                if key in ("policy", "executor gates"):
                    scheduling[f"{Path(filename).name}:{line}({function}) x{calls}"] = tottime
            out.update({f"own_s.{k}": v for k, v in parts.items()})
            top.update(dict(sorted(scheduling.items(), key=lambda kv: -kv[1])[:8]))

    run_on_engine_clock(step, config)
    total = sum(v for k, v in out.items() if k.startswith("own_s."))
    scheduler_s = out.get("own_s.policy", 0.0) + out.get("own_s.executor gates", 0.0)
    turns = out["turns"]
    return {
        "trajectories": trajectories,
        **out,
        "scheduler_share_of_cpu": scheduler_s / total,
        "scheduler_ms_per_turn_profiled": 1e3 * scheduler_s / turns,
        "process_ms_per_turn_profiled": 1e3 * total / turns,
        "sim_engine_ms_per_turn": 1e3 * out["engine_busy_s"] / turns,
        "scheduler_share_of_engine_time": scheduler_s / out["engine_busy_s"],
        "scheduler_top_functions_s": top,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="swe-agent")
    parser.add_argument("--trajectories", default="1024,2048,4096")
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--scheduler", default="auto")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    rows = []
    for n in (int(x) for x in args.trajectories.split(",")):
        rows.append(profile_step(args.workload, n, args.servers, args.scheduler))
        r = rows[-1]
        print(f"{n:>6} trajectories, {r['turns']:.0f} turns: scheduler "
              f"{r['scheduler_ms_per_turn_profiled']:.3f} ms/turn ({100 * r['scheduler_share_of_cpu']:.1f}% of the "
              f"process's CPU; whole process {r['process_ms_per_turn_profiled']:.2f} ms/turn, profiled), sim engine "
              f"{r['sim_engine_ms_per_turn']:.0f} ms/turn: scheduler = "
              f"{100 * r['scheduler_share_of_engine_time']:.3f}% of engine time", flush=True)
    report = {"workload": args.workload, "servers": args.servers, "scheduler": args.scheduler,
              "projection": "simulated engine (virtual time); CPU times are this machine's, under cProfile",
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"scheduler-cpu-{args.workload}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
