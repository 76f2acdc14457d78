"""The bench table (rich) and figure (matplotlib): speedup bars with their spread, and per policy a
timeline of every trajectory (engine work vs. tool wait); and the report's numbers for experiment trackers.

The table is a :class:`rollopt.tables.FitTable`: at any width it shows the policies' essential columns
(scheduler, makespan, speedup) in full, then as many of the others as fit, by priority; the rest are named
under it (they are all in ``--json``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from rollopt.tables import Column, FitTable


def _speedup_key(report: dict[str, Any]) -> str:
    return "speedup_vs_sync" if report["baseline"] == "sync" else "speedup_vs_baseline"


def columns(report: dict[str, Any]) -> list[Column]:
    """The bench table's columns, most essential first by ``priority`` (0: always shown)."""
    key = _speedup_key(report)
    return [
        Column("scheduler", "scheduler", justify="left"),
        Column("risk_class", "risk", priority=1),
        Column("makespan_s", "makespan s", "{:.2f}"),
        Column("makespan_range", "makespan min-max", lambda p: f"{p['makespan_min_s']:.2f}-{p['makespan_max_s']:.2f}",
               priority=2),
        Column(key, f"speedup vs {report['baseline']}", "{:.2f}x"),
        *([Column("speedup_vs_async", "vs async (AgentLoop)", "{:.2f}x")]
          if "speedup_vs_async" in report["policies"][0] else []),
        Column("speedup_range", "speedup min-max", lambda p: f"{p['speedup_min']:.2f}-{p['speedup_max']:.2f}",
               priority=1),
        Column("lower_bound_s", "lower bound s", "{:.2f}", priority=2),
        Column("efficiency", "efficiency", "{:.2f}", priority=1),
        Column("throughput_tok_s", "tok/s", "{:.0f}", priority=2),
        Column("engine_busy_frac", "engine busy", "{:.0%}", priority=1),
        Column("prefill", "prefill / naive",
               lambda p: f"{p['prefill_tokens']:.0f} / {p['naive_prefill_tokens']:.0f}", priority=3),
        Column("cached_tokens", "cached", "{:.0f}", priority=3),
        Column("p50_latency_s", "p50 s", "{:.2f}", priority=3),
        Column("p99_latency_s", "p99 s", "{:.2f}", priority=3),
        Column("lost_tokens", "lost", priority=2),
    ]


def table(report: dict[str, Any]) -> FitTable:
    """The report's policies side by side; print it on a console (it fits that console's width), or turn it
    into text with :func:`rollopt.tables.render_text`."""
    title = (f"rollopt bench · {report['workload']} · {report['engine']} · {report['model']} "
             f"(medians of {report['policies'][0]['repeats']}; speedup vs {report['baseline']})"
             + (f"\n{report['engine_description']}" if report.get("engine_description") else ""))
    return FitTable(report["policies"], columns(report), title=title, more_hint="--json")


def in_turn_overlap(report: dict[str, Any]) -> str | None:
    """One line on what starting tools inside their turn gains, apart from everything else a policy changes: the
    mean latency (first request to last tool end) of the turns that can overlap (several written calls, or text
    after the last one), under each policy that starts tools early against the same policy without it
    (``overlap`` against ``async``, ``auto`` against ``kv``), where both ran. None if no such pair or turns."""
    by_name = {p["scheduler"]: p for p in report["policies"]}
    pairs = [(p, by_name[p["without_early_tools"]]) for p in report["policies"]
             if p.get("without_early_tools") in by_name and p.get("overlappable_turns")]
    if not pairs:
        return None
    parts = ", ".join(f"{p['scheduler']} {p['tool_turn_latency_s']:.2f} s vs {q['scheduler']} "
                      f"{q['tool_turn_latency_s']:.2f} s ({p['tool_turn_latency_s'] / q['tool_turn_latency_s'] - 1:+.1%})"
                      for p, q in pairs)
    return (f"in-turn overlap, the {pairs[0][0]['overlappable_turns']:.0f} turns with several calls or text after a "
            f"call (first request to last tool end): {parts}")


def tracker_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers, flat, for :mod:`rollopt.trainer.trackers`: ``bench/<scheduler>/<field>`` for each
    policy's numeric fields (a bench is one point per policy: log it at one step)."""
    out: dict[str, float] = {}
    for p in report["policies"]:
        for field, value in p.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"bench/{p['scheduler']}/{field}"] = float(value)
    return out


def track_report(report: dict[str, Any], backends: Sequence[str], out_dir: str | Path | None = None, *,
                 wandb_mode: str = "offline") -> Path:
    """Log :func:`tracker_metrics` to each tracker in ``backends`` (``tensorboard``, ``wandb``), once, at step 0,
    under ``out_dir`` (``out_dir/tensorboard``, ``out_dir/wandb``; default ``runs/bench-<workload>``), with the
    report's setup (workload, engine, model, seed, baseline, machine) as the run's config, and return ``out_dir``.
    Names are the report's own, ``bench/<policy>/<field>`` (verl logs no bench). The W&B run is named
    ``bench-<workload>``. Raises :class:`~rollopt.errors.ConfigError` for an unknown backend or a missing
    package, before anything is written."""
    from rollopt.trainer.trackers import build_trackers

    run_name = "bench-" + re.sub(r"[^\w.-]+", "_", str(report["workload"]))  # a user's file.py:Class too
    out_dir = Path(out_dir) if out_dir is not None else Path("runs") / run_name
    config = {k: report[k] for k in ("workload", "engine", "model", "seed", "baseline", "machine") if k in report}
    trackers = build_trackers(backends, out_dir, run_name, config, wandb_mode=wandb_mode, metric_names="rollopt")
    try:
        for tracker in trackers:
            tracker.log(tracker_metrics(report), step=0)
    finally:
        for tracker in trackers:
            tracker.close()
    return out_dir


def plot(report: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = report["policies"]
    key = _speedup_key(report)
    fig, axes = plt.subplots(1 + len(policies), 1, figsize=(10, 2.2 + 2.6 * len(policies)),
                             gridspec_kw={"height_ratios": [1.2] + [2] * len(policies)})
    names = [p["scheduler"] for p in policies]
    meds = [p[key] for p in policies]
    err = [[m - p["speedup_min"] for m, p in zip(meds, policies)], [p["speedup_max"] - m for m, p in zip(meds, policies)]]
    axes[0].bar(names, meds, yerr=err, capsize=4, color="#4477aa")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel(f"speedup vs {report['baseline']}")
    axes[0].set_title(f"{report['workload']} on {report['engine']} ({report['model']})")
    horizon = max(p["makespan_max_s"] for p in policies)
    colors = {"generate": "#4477aa", "prefill": "#228833", "tool": "#ee7733"}
    for ax, p in zip(axes[1:], policies):
        rows = sorted({traj for traj, *_ in p["timeline"]})
        index = {r: i for i, r in enumerate(rows)}
        for traj, kind, start, end in p["timeline"]:
            ax.barh(index[traj], max(end - start, 1e-3), left=start, height=0.8 if kind != "tool" else 0.4,
                    color=colors[kind], linewidth=0)
        ax.set_xlim(0, horizon)
        ax.set_yticks([])
        ax.set_ylabel(f"{p['scheduler']}\n{len(rows)} traj.", fontsize=8)
    axes[-1].set_xlabel("seconds (blue: engine request, orange: tool call, green: shared prefill)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
