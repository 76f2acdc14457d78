"""Token-level policy-gradient loss: PPO clip with dual clip, and loss aggregation that is invariant to
micro-batching.

Notation, per generated token t of a sequence (all log-probabilities of the token actually sampled):

* ``logprobs``      log π_θ(t), the policy being optimised (carries the gradient);
* ``old_logprobs``  log π_old(t), the policy the ratio is taken against (the proximal policy: the trainer's
  recompute before the update, or the engine's behavior logprobs; see :mod:`rollopt.trainer.offpolicy`);
* ``advantages``    A_t (a sequence's advantage broadcast to its tokens);
* ``weights``       w_t ≥ 0, detached per-token weights (importance corrections, staleness; 1 by default).

PPO clip with dual clip (Ye et al. 2020), with r_t = exp(clamp(log π_θ − log π_old, −20, 20)):

    clipped_t = max(−A_t · r_t, −A_t · clip(r_t, 1 − eps_low, 1 + eps_high))
    loss_t    = min(clipped_t, −c · A_t)   if A_t < 0   (dual clip, c > 1: bounds the loss of a negative
                clipped_t                   otherwise     advantage when r_t explodes)
    loss_t   *= w_t

Aggregation (``loss_agg``; M = the token mask, S = the sequences with at least one masked-in token, |·|
counts over the *whole* step batch):

* ``token-mean``:          Σ_{s,t} M·loss / Σ M                      (every token weighs the same)
* ``seq-mean-token-sum``:  Σ_s (Σ_t M·loss) / |S|                    (Dr. GRPO's; long answers weigh more)
* ``seq-mean-token-mean``: Σ_s (Σ_t M·loss / Σ_t M) / |S|            (the original GRPO)

A row left with no token (e.g. every token dropped by the staleness bound) is not in S, as in verl's
``agg_loss``: it would add nothing to the sum but still dilute the mean, by a varying amount from step to step.

Micro-batch invariance: the denominators are counts over the whole batch (``num_tokens``, ``num_seqs``), not
over the micro-batch, so summing the micro-batch losses (and their gradients) gives exactly the full-batch
loss whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LOG_RATIO_CLAMP = 20.0
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
LOSS_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


@dataclass(frozen=True)
class PolicyLossOutput:
    loss_per_token: torch.Tensor  # [B, T], zero outside the mask, already weighted
    clip_frac: torch.Tensor  # fraction of masked tokens where clipping took effect (scalar, detached)
    dual_clip_frac: torch.Tensor  # fraction of masked tokens where the dual clip took effect
    approx_kl: torch.Tensor  # mean(old − new) over masked tokens (k1 of KL(π_old‖π_θ)), detached


def ppo_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, weights: torch.Tensor | None = None, eps_low: float = 0.2,
                    eps_high: float = 0.2, dual_clip_c: float | None = 3.0) -> PolicyLossOutput:
    """Per-token PPO loss (see the module docstring). ``mask`` is boolean; tokens outside it contribute 0
    and their (possibly NaN) inputs never enter the arithmetic."""
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (got {dual_clip_c}); use None to turn the dual clip off")
    mask = mask.bool()
    zero = torch.zeros_like(logprobs)
    # NaN logprobs of prompt/observation tokens must not reach the ratio, even multiplied by 0.
    log_ratio = torch.where(mask, logprobs - torch.where(mask, old_logprobs, zero), zero)
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages, zero)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    n = mask.sum().clamp(min=1)
    clip_frac = ((clipped > unclipped) & mask).sum() / n
    if dual_clip_c is not None:
        bound = -dual_clip_c * adv
        dual = (adv < 0) & (loss > bound) & mask
        loss = torch.where(adv < 0, torch.minimum(loss, bound), loss)
        dual_frac = dual.sum() / n
    else:
        dual_frac = torch.zeros(())
    if weights is not None:
        loss = loss * torch.where(mask, weights, zero)
    loss = torch.where(mask, loss, zero)
    approx_kl = (torch.where(mask, -log_ratio, zero).sum() / n).detach()
    return PolicyLossOutput(loss, clip_frac.detach(), dual_frac.detach(), approx_kl)


def aggregate_loss(loss_per_token: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: int | None = None,
                   num_seqs: int | None = None) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token losses to a scalar (see the module docstring). ``num_tokens`` / ``num_seqs``
    are the whole step batch's counts of masked-in tokens and of rows with at least one (default: this batch's
    own), which makes micro-batches add up."""
    mask = mask.bool()
    masked = torch.where(mask, loss_per_token, torch.zeros_like(loss_per_token))
    if mode == "token-mean":
        total = num_tokens if num_tokens is not None else int(mask.sum())
        return masked.sum() / max(total, 1)
    seqs = num_seqs if num_seqs is not None else int(mask.any(-1).sum())
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(seqs, 1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / max(seqs, 1)
    raise ValueError(f"unknown loss_agg {mode!r}; use one of {LOSS_AGGREGATIONS}")
