"""Off-policy corrections from each token's recorded behavior logprob and policy version.

Three policies meet in an asynchronous RL step, per generated token t:

* μ (behavior): the engine that sampled t, at weight version ``versions[t]``; ``behavior_logprobs[t]`` is
  log μ(t), recorded at sampling time;
* π_prox (proximal): the trainer's current weights before this step's update, scored by the trainer
  (``proximal_logprobs``); it differs from μ by inference numerics (staleness 0) and by version lag (≥ 1);
* π_θ: the weights being optimised.

The PPO ratio is always taken against an ``old`` policy (:func:`rollopt.trainer.losses.ppo_policy_loss`);
a correction chooses that ``old`` policy and a detached per-token weight w_t, with ρ_t = π_prox(t) / μ(t):

========== ============= ================================================================================
correction old policy     weight w_t
========== ============= ================================================================================
none       π_prox         1 (ignores the mismatch; what a synchronous trainer does)
behavior   μ              1 (ratio against the behavior policy; clipping alone bounds the off-policy step)
tis        π_prox         min(ρ_t, C): truncated importance sampling, token level (C = ``is_cap``, 2)
tis-seq    π_prox         min(Π_t ρ_t, C) for every token of the sequence, the product over its kept tokens
                          (not those the staleness bound drops): sequence-level truncated IS
mis        π_prox         ρ_t if ``mis_low`` ≤ ρ_t ≤ ``mis_high`` else 0: masked IS (IcePop-style bounds)
decoupled  π_prox         ρ_t, and 0 where ρ_t > C when ``is_cap`` is set: decoupled PPO (AReaL), where
                          clipping is around the proximal policy and ρ corrects the sampling distribution;
                          the cap *masks* (AReaL's ``behav_imp_weight_cap``), unlike ``tis``, which truncates
========== ============= ================================================================================

A weight of 0 (``mis`` outside its bounds, ``decoupled`` above the cap) removes a token's gradient but not the
token from the mask: it still counts in the loss denominators, as in AReaL, and in ``is_clipped_frac``.

Staleness bound (any correction): lag_t = ``current_version`` − ``versions[t]``. A token with
lag_t > ``max_staleness`` is dropped from the mask (``stale="drop"``) or has its weight multiplied by
``stale_decay`` ** (lag_t − ``max_staleness``) (``stale="downweight"``). ``max_staleness=None`` disables it.
All log-ratios are clamped to ±20 before exponentiation. Tokens outside the loss mask (prompt, observation:
NaN logprobs, version −1) never enter any ratio.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rollopt.errors import ConfigError

CORRECTIONS: tuple[str, ...] = ("none", "behavior", "tis", "tis-seq", "mis", "decoupled")
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class OffPolicyConfig:
    """How to correct for the engine↔trainer gap; see the module docstring."""

    correction: str = "tis"
    is_cap: float | None = 2.0  # C: tis/tis-seq truncate at it, decoupled zeroes tokens above it (None: no cap)
    mis_low: float = 0.5
    mis_high: float = 2.0
    max_staleness: int | None = None
    stale: Literal["drop", "downweight"] = "drop"
    stale_decay: float = 0.5

    def __post_init__(self) -> None:
        if self.correction not in CORRECTIONS:
            raise ConfigError(f"unknown off-policy correction {self.correction!r}; use one of {CORRECTIONS}")
        if self.is_cap is not None and self.is_cap <= 0:
            raise ConfigError(f"is_cap must be > 0 or None, got {self.is_cap}")
        if self.correction in ("tis", "tis-seq") and self.is_cap is None:
            raise ConfigError(f"correction {self.correction!r} truncates at is_cap; set is_cap (e.g. 2.0)")
        if not 0 <= self.mis_low < 1 < self.mis_high:
            raise ConfigError(f"masked IS needs 0 <= mis_low < 1 < mis_high, got {self.mis_low}, {self.mis_high}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.stale not in ("drop", "downweight"):
            raise ConfigError(f"stale must be 'drop' or 'downweight', got {self.stale!r}")
        if not 0 < self.stale_decay < 1:
            raise ConfigError(f"stale_decay must be in (0, 1), got {self.stale_decay}")

    @property
    def needs_proximal(self) -> bool:
        """Whether the trainer must score the batch with its pre-update weights (an extra forward)."""
        return self.correction != "behavior"


@dataclass(frozen=True)
class Correction:
    """What the loss consumes: the ``old`` logprobs of the ratio, the token weights, the (possibly reduced)
    mask, and what happened (for metrics)."""

    old_logprobs: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    stale_dropped: int  # tokens removed by the staleness bound
    is_weight_mean: float  # mean weight over the kept tokens
    is_clipped_frac: float  # fraction of kept tokens whose IS weight was truncated or masked


def correct(behavior_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor | None, versions: torch.Tensor,
            mask: torch.Tensor, current_version: int, config: OffPolicyConfig) -> Correction:
    """Apply ``config`` to one batch (``[B, T]`` tensors aligned as in :class:`rollopt.batch.TrainBatch`)."""
    mask = mask.bool()
    zero = torch.zeros_like(behavior_logprobs)
    behavior = torch.where(mask, behavior_logprobs, zero)
    if config.needs_proximal and proximal_logprobs is None:
        raise ValueError(f"correction {config.correction!r} needs the proximal (pre-update) logprobs")
    proximal = torch.where(mask, proximal_logprobs, zero) if proximal_logprobs is not None else behavior
    log_rho = (proximal - behavior).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    rho = torch.exp(log_rho)
    ones = torch.ones_like(rho)
    lag = current_version - versions
    kept, dropped, decay = mask, 0, ones
    if config.max_staleness is not None:
        over = (lag > config.max_staleness) & mask
        if config.stale == "drop":
            kept, dropped = mask & ~over, int(over.sum())
        else:
            excess = (lag - config.max_staleness).clamp(min=0).to(rho.dtype)
            decay = torch.where(over, config.stale_decay ** excess, ones)
    truncated = torch.zeros_like(mask)
    kind = config.correction
    if kind in ("none", "behavior"):
        weights = ones
    elif kind == "tis":
        weights = rho.clamp(max=config.is_cap)
        truncated = rho > config.is_cap
    elif kind == "tis-seq":
        seq_rho = torch.exp(torch.where(kept, log_rho, zero).sum(-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weights = seq_rho.clamp(max=config.is_cap)[:, None].expand_as(rho)
        truncated = (seq_rho > config.is_cap)[:, None].expand_as(mask)
    elif kind == "mis":
        inside = (rho >= config.mis_low) & (rho <= config.mis_high)
        weights = torch.where(inside, rho, zero)
        truncated = ~inside
    else:  # decoupled
        if config.is_cap is not None:
            truncated = rho > config.is_cap
        weights = torch.where(truncated, zero, rho)
    weights = torch.where(kept, weights * decay, zero).detach()
    n = max(int(kept.sum()), 1)
    return Correction(
        old_logprobs=(behavior if kind == "behavior" else proximal).detach(),
        weights=weights, mask=kept, stale_dropped=dropped,
        is_weight_mean=float(weights[kept].sum()) / n,
        is_clipped_frac=float((truncated & kept).sum()) / n,
    )
