"""One policy update on a batch of scored trajectories: advantages → off-policy correction → PPO loss →
optimizer step(s). Everything here is synchronous torch; the loop runs it in a worker thread.

Order of operations (all on the trainer's weights at version ``current_version``):

1. group-relative advantages per trajectory (:mod:`rollopt.trainer.advantages`), broadcast to its tokens;
2. the proximal logprobs: the batch scored with the pre-update weights, no grad (also the trainer side of
   the mismatch metrics, so it is always computed);
3. the correction (:func:`rollopt.trainer.offpolicy.correct`): the ratio's ``old`` logprobs, token weights,
   and the staleness-bounded mask;
4. ``minibatches`` optimizer steps, each over its share of rows, accumulated over ``micro_batch``-row
   forwards whose losses use the minibatch's counts of tokens and of rows that still have a token (so the
   split does not change the loss).

``ppo_kl`` (k1 approx KL of π_old‖π_θ, mean of old − new) and the clip fractions are token-weighted means over
every micro-batch of every minibatch, as verl reports the mean of its per-micro-batch values. The first
minibatch still trains the proximal weights, where both are 0; so with ``minibatches=1`` they are exactly 0
(the on-policy sanity check), and with more they measure how far the later minibatches moved the policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from rollopt.batch import TrainBatch, collate
from rollopt.trajectory import Trajectory
from rollopt.trainer.advantages import compute_advantages
from rollopt.trainer.distributed import SingleProcess
from rollopt.trainer.losses import aggregate_loss, ppo_policy_loss
from rollopt.trainer.metrics import mismatch_by_staleness
from rollopt.trainer.offpolicy import OffPolicyConfig, correct
from rollopt.trainer.scoring import score


@dataclass(frozen=True)
class UpdateConfig:
    """The algorithm: a recipe's ``[algorithm]`` section, consumed as is by :func:`policy_update` and the
    optimizer."""

    advantage: str = "grpo"
    """Group-relative estimator: ``grpo``, ``dr_grpo`` or ``rloo`` (:mod:`rollopt.trainer.advantages`)."""
    loss_agg: str = "token-mean"
    """``token-mean``, ``seq-mean-token-sum`` or ``seq-mean-token-mean`` (:mod:`rollopt.trainer.losses`)."""
    eps_low: float = 0.2
    """The ratio is clipped to [1 − eps_low, 1 + eps_high]."""
    eps_high: float = 0.28
    """Asymmetric by default: DAPO's clip-higher (0.28 > 0.2); 0.2 gives the symmetric PPO/GRPO clip."""
    dual_clip_c: float | None = 3.0
    """Dual-clip bound on negative-advantage tokens (None: off)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many training steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    minibatches: int = 1
    """Optimizer steps per batch."""
    micro_batch: int = 16
    """Rows per forward/backward (gradient accumulation); does not change the loss."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""


def token_advantages(trajectories: Sequence[Trajectory], batch: TrainBatch, estimator: str) -> torch.Tensor:
    """``[B, T]``: each trajectory's advantage on every position (masked later)."""
    per_traj = compute_advantages(trajectories, estimator)
    return torch.from_numpy(np.asarray(per_traj, np.float32))[:, None].expand_as(batch.behavior_logprobs).clone()


class Tempered(torch.nn.Module):
    """A view of an HF causal LM whose logits are divided by the sampling temperature."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        if self.temperature != 1.0:
            out.logits = out.logits / self.temperature
        return out


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trajectories: Sequence[Trajectory],
                  current_version: int, config: UpdateConfig, off_policy: OffPolicyConfig,
                  pad_token_id: int = 0, data_parallel: SingleProcess | None = None,
                  temperature: float = 1.0) -> dict[str, float]:
    """Update ``model`` in place on ``trajectories`` (see the module docstring); returns step metrics. With
    ``data_parallel`` (:class:`rollopt.trainer.distributed.DataParallel`) every rank passes the whole batch and
    trains on its share of the rows, with the same result as one process (see that module)."""
    if not trajectories:
        raise ValueError("policy_update() needs at least one trajectory")
    dp = data_parallel or SingleProcess()
    scorer = Tempered(model, temperature)  # the engine's logprobs are of logits / the sampling temperature
    batch = collate(trajectories, "padded", pad_token_id=pad_token_id)
    advantages = token_advantages(trajectories, batch, config.advantage)
    advantage_abs_mean = float(advantages[:, 0].abs().mean())
    bounds = np.linspace(0, batch.input_ids.shape[0], config.minibatches + 1).round().astype(int)
    batch, advantages, bounds = dp.shard(batch, advantages, bounds)
    model.eval()  # no dropout in the scored policies: π_prox and π_θ must be the same function at step 0
    with torch.no_grad():
        proximal, _ = score(scorer, batch, micro_batch=config.micro_batch)
    fix = correct(batch.behavior_logprobs, proximal, batch.versions, batch.loss_mask, current_version, off_policy)
    metrics = mismatch_by_staleness(batch.behavior_logprobs, proximal, batch.versions, batch.loss_mask,
                                    current_version)
    sums = {"loss": 0.0, "clip_frac": 0.0, "dual_clip_frac": 0.0, "entropy": 0.0, "ppo_kl": 0.0}
    grad_norms, tokens_seen = [], 0
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        mask_mb = fix.mask[lo:hi]
        # the whole minibatch's counts, over every rank: tokens, and rows with a token left (loss denominators)
        num_tokens, num_seqs = (int(v) for v in dp.sum([mask_mb.sum(), mask_mb.any(-1).sum()]))
        if num_tokens == 0:
            continue
        optimizer.zero_grad(set_to_none=True)
        for start in range(lo, hi, config.micro_batch):
            sl = slice(start, min(start + config.micro_batch, hi))
            logprobs, entropy = score(scorer, batch, rows=sl, with_entropy=True)
            m = fix.mask[sl]
            out = ppo_policy_loss(logprobs, fix.old_logprobs[sl], advantages[sl], m, fix.weights[sl],
                                  config.eps_low, config.eps_high, config.dual_clip_c)
            loss = aggregate_loss(out.loss_per_token, m, config.loss_agg, num_tokens, num_seqs)
            loss.backward()
            n = int(m.sum())
            sums["loss"] += loss.detach().item()
            sums["clip_frac"] += out.clip_frac.item() * n
            sums["dual_clip_frac"] += out.dual_clip_frac.item() * n
            sums["entropy"] += torch.where(m, entropy, torch.zeros_like(entropy)).sum().detach().item()
            sums["ppo_kl"] += out.approx_kl.item() * n
            tokens_seen += n
        dp.reduce_gradients(model.parameters())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        grad_norms.append(float(norm))
        optimizer.step()
    model.eval()
    *totals, tokens_seen = dp.sum([*sums.values(), tokens_seen])
    sums = dict(zip(sums, totals))
    seen = max(tokens_seen, 1)
    metrics.update({
        "loss": sums["loss"] / max(len(grad_norms), 1),
        "clip_frac": sums["clip_frac"] / seen,
        "dual_clip_frac": sums["dual_clip_frac"] / seen,
        "entropy": sums["entropy"] / seen,
        "ppo_kl": sums["ppo_kl"] / tokens_seen if tokens_seen else math.nan,
        "grad_norm": float(np.mean(grad_norms)) if grad_norms else math.nan,
        "is_weight_mean": fix.is_weight_mean,
        "is_clipped_frac": fix.is_clipped_frac,
        "stale_dropped_tokens": float(fix.stale_dropped),
        "train_tokens": float(tokens_seen),
        "advantage_abs_mean": advantage_abs_mean,
        "lr": optimizer.param_groups[0]["lr"],
    })
    return metrics
