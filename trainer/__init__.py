"""The trainer (installed as ``rollopt.trainer``): token-level PPO/GRPO over rollopt trajectories, with
per-token versions and off-policy corrections, and the training loop behind ``rollopt train``.

Modules, one job each: ``advantages`` (GRPO, Dr.GRPO, RLOO), ``losses`` (PPO clip + dual clip, aggregation),
``offpolicy`` (truncated / masked IS, decoupled PPO, staleness bound), ``scoring`` (trainer logprobs),
``metrics`` (rollout stats, mismatch by staleness), ``update`` (one policy update), ``warm_start`` (SFT on
demonstrations), ``checkpoint``, ``recipe`` (TOML recipes), ``loop`` (sync / one-step-off / async), ``plots``.
"""

from rollopt.trainer.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from rollopt.trainer.losses import aggregate_loss, ppo_policy_loss
from rollopt.trainer.offpolicy import OffPolicyConfig, correct

__all__ = ["ADVANTAGE_ESTIMATORS", "OffPolicyConfig", "aggregate_loss", "compute_advantages", "correct",
           "ppo_policy_loss"]
