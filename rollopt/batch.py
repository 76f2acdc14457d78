"""Trajectories → trainer tensors.

Alignment contract: position ``t`` of every tensor describes token ``input_ids[t]``. ``behavior_logprobs[t]``
is the engine's sampling log-probability of ``input_ids[t]`` (NaN unless ``loss_mask[t]``), ``versions[t]``
the weight version that sampled it (−1 unless ``loss_mask[t]``). A trainer that scores token ``t`` with the
logits at ``t − 1`` shifts by one itself; nothing here is shifted.

Two layouts:

* ``padded``: ``[B, T]`` right-padded with ``pad_token_id``; ``attention_mask`` marks real tokens and
  ``position_ids`` count from 0 in each row.
* ``packed``: one row ``[1, N]`` holding every trajectory back to back, ``cu_seqlens`` (``[B + 1]``) marks
  where each starts, and ``position_ids`` restart at 0 for each, as varlen attention kernels expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from rollopt.trajectory import NO_VERSION, Trajectory


@dataclass(frozen=True)
class TrainBatch:
    """Token-aligned trainer inputs; see the module docstring for the alignment contract."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    versions: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    trajectory_ids: tuple[str, ...]

    @property
    def layout(self) -> str:
        return "packed" if self.cu_seqlens is not None else "padded"


def collate(
    trajectories: Sequence[Trajectory],
    layout: Literal["padded", "packed"] = "padded",
    pad_token_id: int = 0,
) -> TrainBatch:
    """Stack trajectories into a :class:`TrainBatch` in the requested layout."""
    if not trajectories:
        raise ValueError("collate() needs at least one trajectory")
    lengths = [len(t) for t in trajectories]
    ids = tuple(t.id for t in trajectories)
    if layout == "packed":
        cat = lambda name: np.concatenate([getattr(t, name) for t in trajectories])
        cu = np.r_[0, np.cumsum(lengths)]
        positions = np.concatenate([np.arange(n) for n in lengths])
        return TrainBatch(
            input_ids=torch.from_numpy(cat("token_ids"))[None],
            loss_mask=torch.from_numpy(np.concatenate([t.loss_mask for t in trajectories]))[None],
            behavior_logprobs=torch.from_numpy(cat("logprobs")).float()[None],
            versions=torch.from_numpy(cat("versions"))[None],
            position_ids=torch.from_numpy(positions)[None],
            attention_mask=None,
            cu_seqlens=torch.from_numpy(cu).to(torch.int32),
            trajectory_ids=ids,
        )
    if layout != "padded":
        raise ValueError(f"unknown layout {layout!r}; use 'padded' or 'packed'")
    rows, width = len(trajectories), max(lengths)
    input_ids = np.full((rows, width), pad_token_id, np.int64)
    loss_mask = np.zeros((rows, width), bool)
    logprobs = np.full((rows, width), np.nan, np.float32)
    versions = np.full((rows, width), NO_VERSION, np.int64)
    attention = np.zeros((rows, width), np.int64)
    for row, traj in enumerate(trajectories):
        n = len(traj)
        input_ids[row, :n] = traj.token_ids
        loss_mask[row, :n] = traj.loss_mask
        logprobs[row, :n] = traj.logprobs
        versions[row, :n] = traj.versions
        attention[row, :n] = 1
    positions = np.broadcast_to(np.arange(width), (rows, width)) * attention
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        loss_mask=torch.from_numpy(loss_mask),
        behavior_logprobs=torch.from_numpy(logprobs),
        versions=torch.from_numpy(versions),
        position_ids=torch.from_numpy(np.ascontiguousarray(positions)),
        attention_mask=torch.from_numpy(attention),
        cu_seqlens=None,
        trajectory_ids=ids,
    )
