"""``rollopt report RUN_DIR``: how a ``rollopt train`` run learned and where its time went.

Reads ``RUN_DIR/metrics.jsonl`` (one line per step, with the rollout's ``timeline/*`` phase times of
:mod:`rollopt.timeline` and the ``attribution/*`` split of :mod:`rollopt.trainer.attribution`). Writes PNGs:
``reward.png``, ``length.png``, ``staleness.png``, ``mismatch.png`` (by staleness bucket, and the rescoring
split) and ``time.png`` (per step: each phase's share of trajectory time, engine busy vs tool wait), and
returns a text summary that names the run's dominant cost.

Definitions (over all steps together): a phase's share = its seconds summed over every trajectory / the
trajectories' summed lifetimes (``timeline/trajectory_s``); engine idle = 1 − ``timeline/engine_busy_s`` /
``timeline/wall_s`` (the share of rollout wall time with no engine request in flight). The dominant cost is
the phase with the largest share. The per-step traces (``RUN_DIR/traces/step-NNNN.trace.json``) hold the same
phases per trajectory, for Perfetto.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollopt.errors import ConfigError
from rollopt.timeline import PHASES

PHASE_LABELS = {"queue": "queue wait", "prefill": "prefill", "resumed": "resume re-prefill", "decode": "decode",
                "tool": "tool wait", "preempted": "preempted"}
BUCKETS = ("lag0", "lag1", "lag2plus")


@dataclass(frozen=True)
class RunSummary:
    steps: int
    phase_share: dict[str, float]  # phase → share of trajectory time, over all steps
    engine_idle: float  # share of rollout wall time with no engine request in flight
    dominant: str  # the phase with the largest share
    rollout_s: float  # means per step
    train_s: float
    sync_s: float
    reward_first: float | None
    reward_last: float | None
    mismatch: dict[str, float]  # bucket → mean |Δlogp| over the steps that had such tokens
    attribution: dict[str, float]  # numerics / lag / total → mean |Δlogp| over the steps that rescored

    def dominant_sentence(self) -> str:
        return (f"dominant cost: {PHASE_LABELS[self.dominant]} {100 * self.phase_share[self.dominant]:.0f}% of "
                f"trajectory time; engine idle {100 * self.engine_idle:.0f}% of rollout wall time")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass the directory `rollopt train --out` wrote")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict[str, Any]]) -> RunSummary:
    timed = [r for r in rows if "timeline/trajectory_s" in r]
    if not timed:
        raise ValueError("metrics.jsonl has no timeline/* keys: the run predates rollout timelines; rerun it")
    lives = sum(r["timeline/trajectory_s"] for r in timed)
    share = {p: sum(r[f"timeline/{p}_s"] for r in timed) / lives for p in PHASES}
    busy = sum(r["timeline/engine_busy_s"] for r in timed) / sum(r["timeline/wall_s"] for r in timed)
    rewards = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    mismatch = {b: m for b in BUCKETS if (m := _mean(rows, f"mismatch/{b}/abs_dlogp")) is not None}
    attribution = {part: m for part in ("numerics", "lag", "total")
                   if (m := _mean(rows, f"attribution/{part}_abs_dlogp")) is not None}
    return RunSummary(len(rows), share, 1.0 - busy, max(share, key=share.__getitem__),
                      _mean(rows, "rollout_s") or 0.0, _mean(rows, "train_s") or 0.0, _mean(rows, "sync_s") or 0.0,
                      rewards[0] if rewards else None, rewards[-1] if rewards else None, mismatch, attribution)


def summary_text(s: RunSummary) -> str:
    reward = "n/a" if s.reward_first is None else f"{s.reward_first:.3f} → {s.reward_last:.3f}"
    lines = [
        f"{s.steps} steps; reward (sampled) {reward}",
        f"per step: rollout {s.rollout_s:.2f} s, train {s.train_s:.2f} s, weight sync {s.sync_s:.3f} s",
        "trajectory time: " + " · ".join(f"{PHASE_LABELS[p]} {100 * s.phase_share[p]:.0f}%" for p in PHASES),
        f"engine busy {100 * (1 - s.engine_idle):.0f}% of rollout wall time",
    ]
    if s.mismatch:
        lines.append("engine↔trainer |Δlogp| by staleness: "
                     + ", ".join(f"{b} {v:.2e}" for b, v in s.mismatch.items()))
    if s.attribution:
        lines.append("stale tokens rescored with their sampling weights: "
                     + ", ".join(f"{k} {v:.2e}" for k, v in s.attribution.items()))
    if s.train_s > s.rollout_s:
        lines.append(f"training ({s.train_s:.2f} s/step) outweighs the rollout ({s.rollout_s:.2f} s/step)")
    lines.append(s.dominant_sentence())
    return "\n".join(lines)


def render(rows: list[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """Write the PNGs (module docstring) into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]

    def series(key: str, positive: bool = False) -> list[float]:  # positive: for a log axis
        values = [r.get(key) for r in rows]
        return [v if v is not None and (v > 0 or not positive) else float("nan") for v in values]

    def figure(name: str, title: str, lines: dict[str, str], ylabel: str = "", log: bool = False) -> Path:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, key in lines.items():
            ax.plot(steps, series(key, positive=log), "o-", ms=3, label=label)
        ax.set(title=title, xlabel="step", ylabel=ylabel, yscale="log" if log else "linear")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=90)
        plt.close(fig)
        return out_dir / name

    paths = [
        figure("reward.png", "reward", {"sampled (mean)": "reward_mean", "greedy eval": "eval_reward"}),
        figure("length.png", "response length (generated tokens)", {"mean": "response_length_mean",
                                                                      "max": "response_length_max"}),
        figure("staleness.png", "staleness of trained tokens",
               {**{f"{b} token share": f"staleness/{b}_frac" for b in BUCKETS}, "mean lag": "staleness/mean"}),
        figure("mismatch.png", "engine↔trainer mismatch", {
            **{f"|Δlogp| {b}": f"mismatch/{b}/abs_dlogp" for b in BUCKETS},
            **{f"stale tokens: {part}": f"attribution/{part}_abs_dlogp" for part in ("numerics", "lag")}},
            ylabel="mean |Δ logprob|", log=True),
    ]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        share = [r.get(f"timeline/{phase}_s", 0.0) / r["timeline/trajectory_s"] if r.get("timeline/trajectory_s")
                 else 0.0 for r in rows]
        ax.bar(steps, share, bottom=bottom, label=PHASE_LABELS[phase])
        bottom = [b + s for b, s in zip(bottom, share)]
    busy = [r["timeline/engine_busy_s"] / r["timeline/wall_s"] if r.get("timeline/wall_s") else float("nan")
            for r in rows]
    ax.plot(steps, busy, "k-o", ms=3, label="engine busy (share of wall)")
    ax.set(title="trajectory time by phase; engine busy vs tool wait", xlabel="step", ylabel="share", ylim=(0, 1.05))
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(out_dir / "time.png", dpi=90)
    plt.close(fig)
    return paths + [out_dir / "time.png"]


def report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[str, list[Path]]:
    """Render ``run_dir``'s PNGs into ``out_dir`` (default ``run_dir/report``); return the summary and paths.
    A run that cannot be reported (malformed or too old ``metrics.jsonl``) raises a one-line ConfigError;
    a missing one, FileNotFoundError."""
    try:
        rows = read_metrics(run_dir)
        paths = render(rows, Path(out_dir) if out_dir is not None else Path(run_dir) / "report")
        return summary_text(summarize(rows)), paths
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
