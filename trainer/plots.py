"""``curves.png`` of a run: reward, staleness, engine↔trainer mismatch by staleness bucket, length and time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_curves(metrics_path: str | Path, out: str | Path, title: str = "",
                others: Sequence[tuple[str, str | Path]] = ()) -> Path:
    """Four panels from ``metrics.jsonl``; ``others`` adds (label, metrics path) reward curves to compare."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    steps = [r["step"] for r in rows]

    def series(name, data=rows):
        return [r.get(name) if r.get(name) is not None else float("nan") for r in data]

    ax = axes[0, 0]
    ax.plot(steps, series("reward_mean"), label="reward (sampled)")
    if any("eval_reward" in r for r in rows):
        ev = [r for r in rows if "eval_reward" in r]
        ax.plot([r["step"] for r in ev], [r["eval_reward"] for r in ev], "o-", label="reward (greedy eval)")
    for label, path in others:
        other = read_metrics(path)
        ax.plot([r["step"] for r in other], series("reward_mean", other), "--", label=label)
    ax.set(title="reward", xlabel="step", ylim=(-0.05, 1.05))
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    for bucket in ("lag0", "lag1", "lag2plus"):
        ax.plot(steps, series(f"staleness/{bucket}_frac"), label=f"{bucket} token share")
    ax.plot(steps, series("stale_dropped_tokens"), alpha=0)  # keeps the axis when nothing is stale
    ax.set(title="staleness of trained tokens", xlabel="step", ylim=(-0.05, 1.05))
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    for bucket in ("lag0", "lag1", "lag2plus"):
        ax.plot(steps, series(f"mismatch/{bucket}/abs_dlogp"), label=f"|Δlogp| {bucket}")
    ax.set(title="engine↔trainer mismatch by staleness", xlabel="step", yscale="symlog", ylabel="mean |Δ logprob|")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    ax.plot(steps, series("rollout_s"), label="rollout s")
    ax.plot(steps, series("train_s"), label="train s")
    ax.plot(steps, series("step_s"), label="step wall s")
    ax2 = ax.twinx()
    ax2.plot(steps, series("response_length_mean"), "k:", label="response tokens")
    ax.set(title="time per step; response length (dotted)", xlabel="step")
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
