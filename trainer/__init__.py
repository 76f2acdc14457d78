"""The trainer (installed as ``rollopt.trainer``): token-level GRPO/PPO over rollopt trajectories."""

from rollopt.trainer.advantages import ADVANTAGE_ESTIMATORS, compute_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "compute_advantages"]
