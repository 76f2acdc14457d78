"""Is the simulated engine a measuring instrument? The same seeded workloads on a real engine and on the sim
calibrated to it, side by side: per-policy makespan and p99 latency, their errors, and the policies' ranking.

    .venv/bin/python bench/sim_validation.py [--engine local] [--cost FILE] [--repeats 3]
                                             [--workloads tool-heavy,long-tail,group-prefix]
                                             [--schedulers sync,async,overlap+prefix,overlap+prefix+preempt]
                                             [--real bench/results/sim-vs-<engine>.json]
                                             [--out bench/results]

Without ``--cost`` it first calibrates the engine (``rollopt calibrate``, 3 rounds of every probe) and writes
``cost-<engine>-tiny.json`` under ``--out``. Then, per workload: ``rollopt bench`` on the real engine
(``--repeats`` interleaved repeats, medians) and on ``--engine sim`` with that cost file and the real engine's
sizes (virtual time: one repeat is enough where no tool latency is random across runs, but the same count runs).
The issue's bar: makespan within ±15%, p99 within ±20%, the same ranking (of the pairs of policies whose real
makespans differ beyond their min–max spread; the order of a tie is noise). Writes
``sim-vs-<engine>.json`` and ``.png`` under ``--out``. ``--real FILE`` takes the real side from an earlier such
file and runs only the sim: how a change to the sim is checked without re-measuring the engine (the real run is
the slow part, and the sim must not be run beside it on this 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rollopt.benchmark.runner import BenchRun, bench, engine_config
from rollopt.benchmark.workloads import get_workload
from rollopt.engines import run as run_on_engine_clock
from rollopt.engines.sim_calibration import EngineSizes, calibrate_engine, load_cost_file
from rollopt.errors import ConfigError
from rollopt.schedulers import split_specs

MAKESPAN_BAR, P99_BAR = 0.15, 0.20


def compare(real: dict, sim: dict) -> list[dict]:
    """Per policy: the real and simulated medians, the relative errors, and each side's rank by makespan."""
    def ranks(report: dict) -> dict[str, int]:
        order = sorted(report["policies"], key=lambda p: p["makespan_s"])
        return {p["scheduler"]: i + 1 for i, p in enumerate(order)}

    real_rank, sim_rank = ranks(real), ranks(sim)
    simulated = {p["scheduler"]: p for p in sim["policies"]}
    rows = []
    for r in real["policies"]:
        s = simulated[r["scheduler"]]
        rows.append({"scheduler": r["scheduler"],
                     "real_makespan_s": r["makespan_s"], "real_makespan_range": [r["makespan_min_s"], r["makespan_max_s"]],
                     "sim_makespan_s": s["makespan_s"], "makespan_error": s["makespan_s"] / r["makespan_s"] - 1,
                     "real_p99_s": r["p99_latency_s"], "sim_p99_s": s["p99_latency_s"],
                     "p99_error": s["p99_latency_s"] / r["p99_latency_s"] - 1,
                     "real_rank": real_rank[r["scheduler"]], "sim_rank": sim_rank[r["scheduler"]],
                     "real_prefill_tokens": r["prefill_tokens"], "sim_prefill_tokens": s["prefill_tokens"]})
    return rows


def recorded_real(path: Path, workload: str, schedulers: tuple[str, ...]) -> tuple[dict, float]:
    """The real side of ``workload`` as an earlier run of this script measured it: per policy the fields
    :func:`compare` reads, and the real run's wall seconds. A missing workload or policy is a one-line error."""
    earlier = {w["workload"]: w for w in json.loads(path.read_text())["workloads"]}
    if workload not in earlier:
        raise SystemExit(f"{path} has no {workload!r} (it has {sorted(earlier)}); drop --real or --workloads")
    rows = {r["scheduler"]: r for r in earlier[workload]["policies"]}
    if missing := [s for s in schedulers if s not in rows]:
        raise SystemExit(f"{path} has no {missing} for {workload!r}; drop --real or pass its --schedulers")
    policies = [{"scheduler": s, "makespan_s": rows[s]["real_makespan_s"],
                 "makespan_min_s": rows[s]["real_makespan_range"][0],
                 "makespan_max_s": rows[s]["real_makespan_range"][1],
                 "p99_latency_s": rows[s]["real_p99_s"], "prefill_tokens": rows[s]["real_prefill_tokens"]}
                for s in schedulers]
    report = {"policies": policies, "engine_description": earlier[workload].get("real_engine", ""),
              "machine": earlier[workload].get("machine"), "recorded_in": str(path)}
    return report, earlier[workload]["wall_s"]["real"]


def distinct_pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs of policies whose real makespans differ beyond the spread (their min–max ranges do not overlap):
    the only pairs whose order means anything on a noisy machine."""
    return [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]
            if a["real_makespan_range"][1] < b["real_makespan_range"][0]
            or b["real_makespan_range"][1] < a["real_makespan_range"][0]]


def ranking_agrees(rows: list[dict]) -> bool:
    """The sim orders every distinct pair (:func:`distinct_pairs`) as the real engine does."""
    return all((a["real_makespan_s"] < b["real_makespan_s"]) == (a["sim_makespan_s"] < b["sim_makespan_s"])
               for a, b in distinct_pairs(rows))


def plot(results: list[dict], path: Path, cost_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results):
        rows = result["policies"]
        xs = range(len(rows))
        real = [r["real_makespan_s"] for r in rows]
        err = [[r["real_makespan_s"] - r["real_makespan_range"][0] for r in rows],
               [r["real_makespan_range"][1] - r["real_makespan_s"] for r in rows]]
        ax.bar([x - 0.2 for x in xs], real, 0.4, yerr=err, label="real (median, min-max)", color="#4C72B0")
        ax.bar([x + 0.2 for x in xs], [r["sim_makespan_s"] for r in rows], 0.4, label="simulated", color="#DD8452")
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['makespan_error']:+.0%}", (x + 0.2, r["sim_makespan_s"]), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(list(xs), [r["scheduler"].replace("+", "+\n") for r in rows], fontsize=7)
        ax.set_title(result["workload"], fontsize=10)
        ax.set_ylabel("makespan s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"sim vs real · {cost_name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="local")
    parser.add_argument("--cost", type=Path, default=None, help="a cost file (default: calibrate now)")
    parser.add_argument("--real", type=Path, default=None,
                        help="an earlier sim-vs-<engine>.json: take the real engine's medians from it and run only "
                             "the sim (after a change to the sim; the same workloads, seeds and policies)")
    parser.add_argument("--workloads", default="tool-heavy,long-tail,group-prefix")
    parser.add_argument("--schedulers", default="sync,async,overlap+prefix,overlap+prefix+preempt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    schedulers = split_specs(args.schedulers)
    args.out.mkdir(parents=True, exist_ok=True)

    cost = args.cost
    if cost is None:
        started = time.perf_counter()
        config = engine_config(args.engine)
        fit = run_on_engine_clock(lambda: calibrate_engine(config, "tiny", repeats=3, progress=print), config)
        cost = fit.save(args.out / f"cost-{args.engine}-tiny.json")
        print(f"calibrated in {time.perf_counter() - started:.0f} s: {fit.cost.name}; wrote {cost}", flush=True)
    cost_name = json.loads(cost.read_text())["name"]

    results = []
    for name in (w for w in args.workloads.split(",") if w):
        workload = get_workload(name)
        real_engine = engine_config(args.engine, workload)
        try:  # the embedded engine is sized per workload; a server's sizes are what calibration read from it
            sizes = EngineSizes.of(real_engine)
        except ConfigError:
            sizes = load_cost_file(cost).sizes
        sim_engine = engine_config("sim", workload, cost_file=str(cost), max_running=sizes.max_running,
                                   prefill_chunk=sizes.prefill_chunk, block_size=sizes.block_size,
                                   max_context=sizes.max_context, kv_tokens=sizes.kv_tokens,
                                   defer_shared_prefill=sizes.defer_shared_prefill,
                                   mixed_prefill=sizes.mixed_prefill)
        run = BenchRun(workload, schedulers, repeats=args.repeats)
        walls = {}
        reports = {}
        recorded = recorded_real(args.real, name, schedulers) if args.real else None
        if recorded is not None:
            reports["real"], walls["real"] = recorded
        for side, engine in (("real", real_engine), ("sim", sim_engine)):
            if side in reports:
                continue
            started = time.perf_counter()
            reports[side] = run_on_engine_clock(lambda: bench(run, engine), engine)
            walls[side] = time.perf_counter() - started
            print(f"{name} on {side}: {walls[side]:.0f} s wall", flush=True)
        rows = compare(reports["real"], reports["sim"])
        results.append({"workload": name, "wall_s": walls, "policies": rows,
                        **({"real_recorded_in": str(args.real)} if args.real else {}),
                        "ranking_agrees": ranking_agrees(rows),
                        "distinct_pairs": len(distinct_pairs(rows)),
                        "makespan_within_bar": all(abs(r["makespan_error"]) <= MAKESPAN_BAR for r in rows),
                        "p99_within_bar": all(abs(r["p99_error"]) <= P99_BAR for r in rows),
                        "real_engine": reports["real"].get("engine_description", args.engine),
                        "sim_engine": reports["sim"].get("engine_description", "sim"),
                        "machine": reports["real"].get("machine")})
        for r in rows:
            print(f"  {r['scheduler']:>24}: real {r['real_makespan_s']:7.2f} s, sim {r['sim_makespan_s']:7.2f} s "
                  f"({r['makespan_error']:+.0%}); p99 {r['real_p99_s']:.2f} vs {r['sim_p99_s']:.2f} "
                  f"({r['p99_error']:+.0%}); rank {r['real_rank']} vs {r['sim_rank']}", flush=True)

    out = {"engine": args.engine, "cost_file": str(cost), "cost_model": cost_name, "repeats": args.repeats,
           "bars": {"makespan": MAKESPAN_BAR, "p99": P99_BAR}, "workloads": results}
    path = args.out / f"sim-vs-{args.engine}.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    plot(results, path.with_suffix(".png"), cost_name)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
