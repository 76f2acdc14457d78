"""Per-step training metrics: rollout statistics and the engine↔trainer mismatch bucketed by staleness.

Mismatch, per generated token with behavior logprob log μ (engine, at sampling time) and trainer logprob
log π (the trainer's pre-update weights), log r = log π − log μ, estimators of KL(μ‖π) under samples of μ:

* ``k1`` = mean(−log r), ``k2`` = mean(½ (log r)²), ``k3`` = mean(r − 1 − log r) (Schulman's estimators);
* ``abs_dlogp`` = mean |log π − log μ|.

Each is reported per staleness bucket (lag = trainer version − token version): ``lag0`` isolates inference
numerics (same weights, different kernels), ``lag1``, ``lag2plus`` add version lag. A run whose gap lives in
``lag0`` has a numerics problem; one whose gap grows with lag has an asynchrony problem. Caveat: with in-place
weight updates (async modes) a request in flight keeps KV computed by older weights, which shows up in ``lag0``
too; :mod:`rollopt.trainer.attribution` splits the gap of stale tokens exactly by rescoring them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from rollopt.trajectory import Status, Trajectory

STALENESS_BUCKETS: tuple[tuple[str, int, int], ...] = (("lag0", 0, 0), ("lag1", 1, 1), ("lag2plus", 2, 1 << 30))


def mismatch_by_staleness(behavior_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, versions: torch.Tensor,
                          mask: torch.Tensor, current_version: int) -> dict[str, float]:
    """``mismatch/{bucket}/{k1,k2,k3,abs_dlogp}`` and ``staleness/{bucket}_frac`` (share of generated tokens),
    plus ``staleness/mean`` and ``staleness/max``. Buckets without tokens are omitted."""
    mask = mask.bool()
    lag = (current_version - versions)[mask]
    log_r = (trainer_logprobs[mask] - behavior_logprobs[mask]).double().clamp(-20, 20)
    out: dict[str, float] = {}
    total = int(mask.sum())
    if total == 0:
        return out
    out["staleness/mean"] = float(lag.double().mean())
    out["staleness/max"] = int(lag.max())
    for name, lo, hi in STALENESS_BUCKETS:
        sel = (lag >= lo) & (lag <= hi)
        n = int(sel.sum())
        out[f"staleness/{name}_frac"] = n / total
        if n == 0:
            continue
        lr = log_r[sel]
        out[f"mismatch/{name}/k1"] = float((-lr).mean())
        out[f"mismatch/{name}/k2"] = float((0.5 * lr * lr).mean())
        out[f"mismatch/{name}/k3"] = float((lr.exp() - 1 - lr).mean())
        out[f"mismatch/{name}/abs_dlogp"] = float(lr.abs().mean())
        out[f"mismatch/{name}/tokens"] = n
    return out


def rollout_metrics(trajectories: Sequence[Trajectory], max_new_tokens: int | None = None) -> dict[str, float]:
    """Reward, response length, truncation rate, turns, tool calls and failure counts of one batch."""
    # sorted: the batch's statistics must not depend on the order trajectories finished in (float sums do)
    rewards = np.sort(np.array([t.reward if t.reward is not None else np.nan for t in trajectories], dtype=float))
    lengths = np.array([t.num_generated for t in trajectories], dtype=float)
    turns = np.array([len(t.turns) for t in trajectories], dtype=float)
    calls = np.array([len(t.tool_calls) for t in trajectories], dtype=float)
    failed_tools = sum(1 for t in trajectories for r in t.tool_results if not r.ok)
    return {
        "reward_mean": float(np.nanmean(rewards)) if np.isfinite(rewards).any() else float("nan"),
        "reward_std": float(np.nanstd(rewards)) if np.isfinite(rewards).any() else float("nan"),
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_frac": float(np.mean([t.status is Status.TRUNCATED for t in trajectories])),
        "failed_frac": float(np.mean([t.status is Status.FAILED for t in trajectories])),
        "turns_mean": float(turns.mean()),
        "tool_calls_mean": float(calls.mean()),
        "tool_errors": float(failed_tools),
        "trajectories": float(len(trajectories)),
    }
