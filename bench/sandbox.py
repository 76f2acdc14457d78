"""Sandbox pool: warm-pool vs cold-spawn latency per call, and throughput at 1, 8 and 32 concurrent calls.

    .venv/bin/python bench/sandbox.py [--repeats 3] [--calls 40] [--concurrency 1,8,32] [--out bench/results]

* **Latency** of one small call (``print(sum(range(1000)))``): *warm* = a call to an already started pool;
  *cold* = what a sandbox per call costs: start a one-worker pool (bwrap + interpreter + supervisor), run the
  call (teardown is not counted). ``--calls`` warm and ``--calls``/4 cold calls per repeat, interleaved.
* **Throughput** (calls/s) of a warm pool with one worker per concurrent caller (started before the clock
  starts), ``--calls``/2 calls per caller, for two programs: ``cpu`` (about 2 ms of arithmetic: bound by
  this machine's cores) and ``io`` (sleeps
  50 ms: what concurrency buys for tools that wait).

Medians and min–max (or p10–p90 for per-call latency) over repeats; writes ``sandbox.json`` and
``sandbox.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import anyio
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rollopt.environments.sandbox import SandboxLimits, SandboxPool  # noqa: E402

SMALL = "print(sum(range(1000)))"
PROGRAMS = {"cpu": "print(sum(i * i for i in range(20000)))", "io": "import time; time.sleep(0.05); print(1)"}
LIMITS = SandboxLimits(timeout_s=30.0, cpu_s=30)


async def warm_latencies(calls: int) -> list[float]:
    async with SandboxPool(1, LIMITS) as pool:
        await pool.run(SMALL)
        out = []
        for _ in range(calls):
            started = time.perf_counter()
            result = await pool.run(SMALL)
            out.append(time.perf_counter() - started)
            assert result.ok, result
    return out


async def cold_latencies(calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        async with SandboxPool(1, LIMITS) as pool:
            result = await pool.run(SMALL)
            out.append(time.perf_counter() - started)
        assert result.ok, result
    return out


async def throughput(concurrency: int, calls_each: int, program: str) -> float:
    async with SandboxPool(concurrency, LIMITS) as pool:
        async def caller() -> None:
            for _ in range(calls_each):
                result = await pool.run(program)
                assert result.ok, result

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(caller)
        return concurrency * calls_each / (time.perf_counter() - started)


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"median": statistics.median(values), "p10": pick(0.1), "p90": pick(0.9), "min": ordered[0],
            "max": ordered[-1], "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40, help="warm calls per repeat (cold: /4, per caller: /2)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    warm: list[float] = []
    cold: list[float] = []
    rates: dict[str, dict[int, list[float]]] = {name: {c: [] for c in levels} for name in PROGRAMS}
    for rep in range(args.repeats):
        warm += anyio.run(warm_latencies, args.calls)
        cold += anyio.run(cold_latencies, max(1, args.calls // 4))
        for name, program in PROGRAMS.items():
            for c in levels:
                rates[name][c].append(anyio.run(throughput, c, max(1, args.calls // 2), program))
        print(f"repeat {rep + 1}: warm {statistics.median(warm) * 1e3:.1f} ms, "
              f"cold {statistics.median(cold) * 1e3:.1f} ms, "
              + ", ".join(f"{n}@{c} {rates[n][c][-1]:.0f}/s" for n in PROGRAMS for c in levels), flush=True)
    latency = {"warm_s": spread(warm), "cold_s": spread(cold)}
    ratio = latency["cold_s"]["median"] / latency["warm_s"]["median"]
    tput = {name: {str(c): {"median": statistics.median(v), "min": min(v), "max": max(v)} for c, v in per.items()}
            for name, per in rates.items()}
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    report = {"benchmark": "sandbox", "repeats": args.repeats, "calls": args.calls, "programs": PROGRAMS,
              "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "bubblewrap": bwrap, "load_avg_1m_at_end": os.getloadavg()[0]},
              "latency": latency, "cold_over_warm_median": ratio, "throughput_calls_per_s": tput}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sandbox.json").write_text(json.dumps(report, indent=2))
    plot(report, levels, args.out / "sandbox.png")
    print(f"warm {latency['warm_s']['median'] * 1e3:.1f} ms (p10-p90 {latency['warm_s']['p10'] * 1e3:.1f}-"
          f"{latency['warm_s']['p90'] * 1e3:.1f}), cold {latency['cold_s']['median'] * 1e3:.1f} ms (p10-p90 "
          f"{latency['cold_s']['p10'] * 1e3:.1f}-{latency['cold_s']['p90'] * 1e3:.1f}): cold/warm {ratio:.1f}x")
    for name in PROGRAMS:
        print(f"{name}: " + ", ".join(f"{c} concurrent {tput[name][str(c)]['median']:.0f} calls/s "
                                      f"[{tput[name][str(c)]['min']:.0f}-{tput[name][str(c)]['max']:.0f}]"
                                      for c in levels))


def plot(report: dict, levels: list[int], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    lat = report["latency"]
    meds = [lat[k]["median"] * 1e3 for k in ("warm_s", "cold_s")]
    err = [[m - lat[k]["p10"] * 1e3 for m, k in zip(meds, ("warm_s", "cold_s"))],
           [lat[k]["p90"] * 1e3 - m for m, k in zip(meds, ("warm_s", "cold_s"))]]
    left.bar(["warm pool", "cold spawn"], meds, yerr=err, capsize=4, color=["#4477aa", "#cc6677"])
    left.set_yscale("log")
    left.set_ylabel("latency per call, ms (p10–p90)")
    left.set_title(f"cold/warm = {report['cold_over_warm_median']:.0f}x")
    for name, color in (("cpu", "#4477aa"), ("io", "#228833")):
        t = report["throughput_calls_per_s"][name]
        med = [t[str(c)]["median"] for c in levels]
        right.errorbar(levels, med, yerr=[[m - t[str(c)]["min"] for m, c in zip(med, levels)],
                                          [t[str(c)]["max"] - m for m, c in zip(med, levels)]],
                       marker="o", capsize=3, color=color, label=f"{name}: {report['programs'][name][:28]}…")
    right.set_xscale("log", base=2)
    right.set_xticks(levels, [str(c) for c in levels])
    right.set_xlabel("concurrent calls (one warm worker each)")
    right.set_ylabel("calls/s")
    right.legend(fontsize=7)
    fig.suptitle(f"sandbox pool on {report['machine']['cores']} cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
