"""The bench table (rich) and figure (matplotlib): speedup bars with their spread, and per policy a
timeline of every trajectory (engine work vs. tool wait)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table


def table(report: dict[str, Any]) -> Table:
    key = "speedup_vs_sync" if report["baseline"] == "sync" else "speedup_vs_baseline"
    t = Table(title=f"rollopt bench · {report['workload']} · {report['engine']} · {report['model']} "
                    f"(medians of {report['policies'][0]['repeats']}; speedup vs {report['baseline']})")
    for col in ("scheduler", "risk", "makespan s [min-max]", "speedup [min-max]", "lower bound s", "efficiency",
                "tok/s", "engine busy", "prefill / naive", "cached", "p50 s", "p99 s", "lost"):
        t.add_column(col, justify="right")
    for p in report["policies"]:
        t.add_row(p["scheduler"], p["risk_class"],
                  f"{p['makespan_s']:.2f} [{p['makespan_min_s']:.2f}-{p['makespan_max_s']:.2f}]",
                  f"{p[key]:.2f}x [{p['speedup_min']:.2f}-{p['speedup_max']:.2f}]",
                  f"{p['lower_bound_s']:.2f}", f"{p['efficiency']:.2f}", f"{p['throughput_tok_s']:.0f}",
                  f"{p['engine_busy_frac']:.0%}", f"{p['prefill_tokens']:.0f} / {p['naive_prefill_tokens']:.0f}",
                  f"{p['cached_tokens']:.0f}", f"{p['p50_latency_s']:.2f}", f"{p['p99_latency_s']:.2f}",
                  str(p["lost_tokens"]))
    return t


def plot(report: dict[str, Any], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = report["policies"]
    key = "speedup_vs_sync" if report["baseline"] == "sync" else "speedup_vs_baseline"
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
