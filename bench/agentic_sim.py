"""Agentic rollouts at scale on the simulated engine (a projection): ``async`` (verl's AgentLoop) against the
policies that manage KV, side by side in one run per configuration.

    .venv/bin/python bench/agentic_sim.py [--workload swe-agent] [--trajectories 1024] [--servers 1]
                                          [--schedulers async,kv] [--repeats 3] [--hardware H200]
                                          [--model-shape llama-3.1-8b] [--no-rebalance] [--out bench/results]

Every figure is virtual time on the simulated engine (SGLang's scheduling and KV mechanics, each iteration
timed by the GPU roofline of ``--hardware`` for ``--model-shape``): a projection, not a measurement of a GPU.
The workload's trajectories (``--trajectories``, in groups of the profile's size) are the same for every policy
(seeded plans); ``--servers`` simulated servers sit behind the real ``RoutedEngine``. Policies run interleaved
(A B, A B, ...). ``--no-rebalance`` keeps each group on the server it first landed on (the router before
2026-12-06). Writes ``agentic-<workload>-<trajectories>x<servers>[-norebalance].json`` and ``.png`` under ``--out``:
the ``rollopt bench`` report (medians, min–max, efficiency against the lower bound) plus this machine's wall seconds
per policy run (the scheduler's and executor's own CPU cost: virtual time makes the engine free).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rollopt.benchmark.report import plot, table
from rollopt.benchmark.runner import BenchRun, bench, engine_config, save_report
from rollopt.benchmark.workloads import get_workload
from rollopt.engines import run as run_on_engine_clock
from rollopt.schedulers import split_specs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="swe-agent")
    parser.add_argument("--trajectories", type=int, default=1024)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--schedulers", default="async,kv")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hardware", default="H200")
    parser.add_argument("--model-shape", default="llama-3.1-8b")
    parser.add_argument("--no-rebalance", action="store_true",
                        help="with --servers > 1: the router never moves a group off its first server")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    probe = get_workload(args.workload)
    if args.trajectories % probe.group_size:
        parser.error(f"--trajectories must be a multiple of {args.workload}'s group size {probe.group_size}")
    workload = get_workload(args.workload, tasks=args.trajectories // probe.group_size)
    engine = engine_config("sim", workload, hardware=args.hardware, model_shape=args.model_shape,
                           servers=args.servers, max_running=workload.max_running, rebalance=not args.no_rebalance)
    schedulers = split_specs(args.schedulers)
    wall: dict[str, list[float]] = {name: [] for name in schedulers}
    last = [time.perf_counter()]

    def on_step(name: str, rep: int) -> None:
        now = time.perf_counter()
        wall[name].append(now - last[0])
        last[0] = now
        print(f"  {name} repeat {rep + 1}: {wall[name][-1]:.0f} s wall", flush=True)

    def run():
        last[0] = time.perf_counter()
        return bench(BenchRun(workload, schedulers, repeats=args.repeats), engine, on_step=on_step)

    report = run_on_engine_clock(run, engine)
    report["projection"] = (f"simulated engine ({report['engine_description']}); {args.servers} server(s)"
                            f"{' without rebalancing' * args.no_rebalance}; virtual time, not a GPU measurement")
    report["wall_s_per_run"] = {name: {"median": statistics.median(w), "min": min(w), "max": max(w)}
                                for name, w in wall.items()}
    stem = args.out / f"agentic-{args.workload}-{args.trajectories}x{args.servers}{'-norebalance' * args.no_rebalance}"
    save_report(report, stem.with_suffix(".json"))
    plot(report, stem.with_suffix(".png"))
    from rich.console import Console

    Console(width=120).print(table(report))
    print(json.dumps({p["scheduler"]: {k: p[k] for k in ("makespan_s", "makespan_min_s", "makespan_max_s",
                                                           "efficiency", "p99_latency_s", "prefill_tokens",
                                                           "tool_turn_latency_s")}
                      for p in report["policies"]}, indent=1))


if __name__ == "__main__":
    main()
