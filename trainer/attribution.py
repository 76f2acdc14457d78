"""Logprob-mismatch attribution: how much of the engine↔trainer gap on stale tokens is inference numerics,
and how much is version lag.

For a generated token t sampled with weight version v, trained when the trainer holds version ``current``
(staleness = current − v ≥ 1), three logprobs of the tempered policy (logits / sampling temperature):

* b_t = log μ_v(t), the engine's sampling logprob (behavior): version v's weights, the engine's kernels;
* r_t = log π_v(t), the trainer's logprob with version v's weights (kept in :class:`WeightHistory`: the very
  tensors the trainer synced to the engine as version v);
* c_t = log π_current(t), the trainer's logprob with its current weights (the update's proximal policy).

Then c_t − b_t = (r_t − b_t) + (c_t − r_t) exactly: **numerics** (same weights; engine vs trainer kernels) plus
**version lag** (same kernels; weights v vs current). Over a seeded sample of ``sequences`` trajectories that
hold stale tokens, means over their stale tokens:

* ``attribution/total_abs_dlogp`` = mean |c − b|, ``attribution/numerics_abs_dlogp`` = mean |r − b| and
  ``attribution/lag_abs_dlogp`` = mean |c − r| (absolute values do not add up: total ≤ numerics + lag);
* ``attribution/{total,numerics,lag}_dlogp``: the signed means, where total = numerics + lag exactly;
* ``attribution/tokens`` (attributed) and ``attribution/unattributed_tokens`` (sampled stale tokens whose
  version is no longer kept, e.g. sampled before a resume).

r and c come from forwards over the same padded batch, so identical weights give lag exactly 0, and an engine
that computes what the trainer computes gives numerics exactly 0. "Numerics" is everything on the engine side
at equal weights: kernels, and also context KV that the engine computed with *older* weights — a request in
flight across an in-place weight update (the embedded engine and SGLang both keep its KV) samples version-v
tokens on top of version-(v−1) KV, which rescoring with v recomputes. On the fp32 embedded engine the kernels
agree to ~1e-6, so a numerics term well above that measures this mixed-KV effect.

This complements the staleness buckets of :func:`rollopt.trainer.metrics.mismatch_by_staleness` (``lag0`` is
numerics on fresh tokens; ``lag1`` and ``lag2plus`` mix both): rescoring separates the two on the stale tokens
themselves. Cost: one forward of the sampled sequences per version they hold, plus one with the current weights
(counted in ``train_s``).
"""

from __future__ import annotations

import copy
from typing import Mapping, Sequence

import numpy as np
import torch

from rollopt.batch import collate
from rollopt.trajectory import Trajectory
from rollopt.trainer.scoring import score
from rollopt.trainer.update import Tempered


class WeightHistory:
    """The weights synced to the engine at each of the newest ``keep`` versions (the tensors themselves are
    never modified: the trainer syncs detached copies)."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"WeightHistory keeps at least one version, got keep={keep}")
        self.keep = keep
        self._weights: dict[int, Mapping[str, torch.Tensor]] = {}

    def record(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights[version] = weights
        for old in sorted(self._weights)[: -self.keep]:
            del self._weights[old]

    def get(self, version: int) -> Mapping[str, torch.Tensor] | None:
        return self._weights.get(version)

    @property
    def versions(self) -> list[int]:
        return sorted(self._weights)


def split_mismatch(behavior: torch.Tensor, rescored: torch.Tensor, current: torch.Tensor,
                   stale: torch.Tensor) -> dict[str, float]:
    """The ``attribution/*`` metrics (module docstring) over the ``stale`` positions; a position whose
    ``rescored`` logprob is NaN (version not kept) counts as unattributed."""
    attributed = stale & torch.isfinite(rescored)
    out = {"attribution/tokens": int(attributed.sum()),
           "attribution/unattributed_tokens": int((stale & ~attributed).sum())}
    if not attributed.any():
        return out
    b, r, c = (x[attributed].double() for x in (behavior, rescored, current))
    for name, diff in (("total", c - b), ("numerics", r - b), ("lag", c - r)):
        out[f"attribution/{name}_dlogp"] = float(diff.mean())
        out[f"attribution/{name}_abs_dlogp"] = float(diff.abs().mean())
    return out


def attribute_mismatch(model: torch.nn.Module, trajectories: Sequence[Trajectory], current_version: int,
                       history: WeightHistory, *, sequences: int, seed: int, temperature: float = 1.0,
                       pad_token_id: int = 0) -> dict[str, float]:
    """Split the gap on a seeded sample of ``sequences`` trajectories holding tokens older than
    ``current_version`` (``model`` holds the current weights and is left unchanged); ``{}`` when none do."""
    stale_trajs = [t for t in trajectories if np.any(t.versions[t.loss_mask] < current_version)]
    if not stale_trajs or sequences < 1:
        return {}
    rng = np.random.default_rng(seed)
    picked = sorted(rng.choice(len(stale_trajs), size=min(sequences, len(stale_trajs)), replace=False))
    batch = collate([stale_trajs[i] for i in picked], "padded", pad_token_id=pad_token_id)
    stale = batch.loss_mask & (batch.versions < current_version)
    with torch.no_grad():
        current, _ = score(Tempered(model, temperature), batch)
        rescored = torch.full_like(current, float("nan"))
        scratch = copy.deepcopy(model).eval()
        for version in batch.versions[stale].unique().tolist():
            weights = history.get(version)
            if weights is None:
                continue
            scratch.load_state_dict(weights)
            logprobs, _ = score(Tempered(scratch, temperature), batch)
            at = stale & (batch.versions == version)
            rescored[at] = logprobs[at]
    return split_mismatch(batch.behavior_logprobs, rescored, current, stale)
