"""Group-relative advantage estimators: one scalar per trajectory, broadcast to its generated tokens.

For a group of G samples of one prompt with rewards r_1..r_G:

* ``grpo``:    A_i = (r_i − mean(r)) / (std(r) + 1e-6), with the unbiased (n − 1) std;
* ``dr_grpo``: A_i = r_i − mean(r) (Dr. GRPO drops the std, which biases toward easy/hard prompts);
* ``rloo``:    A_i = r_i − mean(r_{j≠i}) = G/(G−1) · (r_i − mean(r)) (leave-one-out baseline).

A group of one (G = 1: its siblings were filtered out or are still running) has no baseline; as in verl
(``compute_*_outcome_advantage``) it is taken as mean 0 and std 1, so ``grpo`` gives r / (1 + 1e-6) and
``dr_grpo`` and ``rloo`` give r.

A missing reward (``None``) is refused: a failed trajectory must be scored (or filtered) explicitly, never
silently counted as 0.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Sequence

import numpy as np

from rollopt.errors import ConfigError
from rollopt.trajectory import Trajectory

EPS = 1e-6


def grpo(rewards: np.ndarray) -> np.ndarray:
    if len(rewards) < 2:
        return rewards / (1.0 + EPS)  # verl: mean 0, std 1
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + EPS)


def dr_grpo(rewards: np.ndarray) -> np.ndarray:
    if len(rewards) < 2:
        return rewards.copy()  # verl: mean 0
    return rewards - rewards.mean()


def rloo(rewards: np.ndarray) -> np.ndarray:
    g = len(rewards)
    if g < 2:
        return rewards.copy()  # verl: no leave-one-out baseline, mean 0
    return g / (g - 1) * (rewards - rewards.mean())


ADVANTAGE_ESTIMATORS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}


def compute_advantages(trajectories: Sequence[Trajectory], estimator: str = "grpo") -> np.ndarray:
    """Per-trajectory advantages, grouped by ``group_id``, in input order."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(f"unknown advantage estimator {estimator!r}; use one of {sorted(ADVANTAGE_ESTIMATORS)}")
    missing = [t.id for t in trajectories if t.reward is None]
    if missing:
        raise ValueError(f"trajectories without a reward: {missing[:5]}; score or filter them first")
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(trajectories):
        groups[t.group_id].append(i)
    out = np.zeros(len(trajectories))
    fn = ADVANTAGE_ESTIMATORS[estimator]
    for idx in groups.values():
        out[idx] = fn(np.array([trajectories[i].reward for i in idx], dtype=np.float64))
    return out
