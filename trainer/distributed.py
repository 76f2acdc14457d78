"""Data-parallel policy updates with ``torch.distributed`` under ``torchrun``: each rank scores and
differentiates its share of a step's batch, gradients are summed across ranks, and the update equals one
process training on the whole batch (up to the order of float sums).

How the equality holds (:func:`rollopt.trainer.update.policy_update` with ``data_parallel=``):

* every rank holds the whole step batch (rank 0's rollout, sent with :meth:`DataParallel.broadcast_object`),
  the same weights (:meth:`DataParallel.broadcast_parameters`, once at start) and the same optimizer state;
* advantages are computed on the whole batch (they are group-relative and a group may span ranks); then each
  minibatch's rows ``[lo, hi)`` are split into ``world_size`` contiguous slices and rank ``r`` keeps slice ``r``
  (:meth:`DataParallel.shard`), still padded to the whole batch's width, so a row is scored exactly as alone;
* loss denominators are global (:mod:`rollopt.trainer.losses`): ``token-mean`` divides by the minibatch's token
  count summed over ranks, ``seq-mean-*`` by its count of rows that still have a token, summed over ranks, so
  a rank's loss is its rows' part of the one-process loss; the gradients are therefore *summed* over ranks
  (one all-reduce per optimizer step, after the micro-batches, before clipping), and every rank clips the same
  global gradient and takes the same step. A parameter that got no gradient on any rank keeps ``grad = None``,
  as in one process.
* the reported loss, clip fractions, entropy, ``ppo_kl`` and ``train_tokens`` are reduced over ranks as well;
  the mismatch and importance-weight metrics describe this rank's rows.

Why not ``DistributedDataParallel``: DDP all-reduces at every backward (each micro-batch) unless inside
``no_sync``, averages rather than sums (the loss would need scaling by the world size), and hangs when ranks
run different numbers of backward passes, which uneven shards do (a rank can hold no row of a minibatch). One
explicit all-reduce per optimizer step has none of these problems. Sharding the weights themselves (FSDP2
``fully_shard``) for a model that does not fit one device is not done here; the row split and the global
denominators above would carry over unchanged.

In the training loop (``torchrun ... -m rollopt.trainer.torchrun``) rank 0 is the usual
:class:`~rollopt.trainer.loop.Trainer`: it alone rolls out, holds the engine, syncs weights and writes metrics
and checkpoints. It sends the other ranks a :class:`Replica` once (its weights, by tensor broadcast, and its
optimizer state and update settings), then one :class:`UpdateOrder` per update (the version, learning rate and
trajectories), then ``None`` to stop; they run the same ``policy_update`` on their rows. Weight sync: after
each update rank 0 pushes its weights to the inference engine (a ``RoutedEngine`` fans them out to every
server); the other ranks hold no engine and learn each version from the next order.
"""

from __future__ import annotations

import os
from datetime import timedelta
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rollopt.batch import TrainBatch
from rollopt.errors import ConfigError
from rollopt.trainer.offpolicy import OffPolicyConfig
from rollopt.trajectory import Trajectory

if TYPE_CHECKING:  # update.py imports this module
    from rollopt.trainer.update import UpdateConfig


def take_rows(batch: TrainBatch, index: torch.Tensor) -> TrainBatch:
    """Rows ``index`` of a padded batch, at the same width."""
    if batch.layout != "padded":
        raise ValueError("take_rows() takes the padded layout")
    return replace(batch, input_ids=batch.input_ids[index], loss_mask=batch.loss_mask[index],
                   behavior_logprobs=batch.behavior_logprobs[index], versions=batch.versions[index],
                   position_ids=batch.position_ids[index], attention_mask=batch.attention_mask[index],
                   trajectory_ids=tuple(batch.trajectory_ids[i] for i in index.tolist()))


class SingleProcess:
    """The trivial data-parallel group: one rank holding every row (what ``policy_update`` uses by default)."""

    rank, world_size = 0, 1

    def shard(self, batch: TrainBatch, advantages: torch.Tensor,
              bounds: np.ndarray) -> tuple[TrainBatch, torch.Tensor, np.ndarray]:
        return batch, advantages, bounds

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        return None

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class DataParallel(SingleProcess):
    """This process's place in a data-parallel group of ``torch.distributed`` (``group=None``: the default
    process group, e.g. the one :func:`init_from_env` makes under ``torchrun``)."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call init_from_env() (under torchrun) first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def rows(self, lo: int, hi: int) -> tuple[int, int]:
        """This rank's contiguous slice of rows ``[lo, hi)`` (slices differ in size by at most one)."""
        cuts = np.linspace(lo, hi, self.world_size + 1).round().astype(int)
        return int(cuts[self.rank]), int(cuts[self.rank + 1])

    def shard(self, batch: TrainBatch, advantages: torch.Tensor,
              bounds: np.ndarray) -> tuple[TrainBatch, torch.Tensor, np.ndarray]:
        """This rank's rows of each minibatch ``[bounds[i], bounds[i+1])``, and the minibatch bounds in them."""
        if batch.input_ids.shape[0] < self.world_size:
            raise ConfigError(f"{batch.input_ids.shape[0]} trajectories cannot be split over {self.world_size} "
                              "ranks; give each step at least world_size trajectories")
        parts = [self.rows(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
        index = torch.cat([torch.arange(lo, hi) for lo, hi in parts])
        local_bounds = np.r_[0, np.cumsum([hi - lo for lo, hi in parts])]
        return take_rows(batch, index), advantages[index], local_bounds

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the ranks (float64)."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t.tolist()

    def reduce_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum every gradient over the ranks in one all-reduce. A rank without a gradient for a parameter adds
        zeros; one that no rank has stays ``None``."""
        params = [p for p in parameters if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in params] + [torch.tensor([float(p.grad is not None) for p in params])])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        present = flat[-len(params):]
        offset = 0
        for p, has in zip(params, present.tolist()):
            n = p.numel()
            if has:
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
            offset += n

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Make every rank's weights (and buffers) rank 0's."""
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0, group=self.group)

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (pickled; e.g. the step's trajectories)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


@dataclass(frozen=True)
class Replica:
    """What the other ranks need, besides rank 0's weights, to mirror rank 0 before its first update."""

    optimizer_class: type
    optimizer_state: dict[str, Any]  # ``optimizer.state_dict()``: hyperparameters and moments
    update_config: "UpdateConfig"
    off_policy: OffPolicyConfig
    pad_token_id: int
    temperature: float  # the rollout's sampling temperature (the trainer scores logits / temperature)


@dataclass(frozen=True)
class UpdateOrder:
    """One policy update, as rank 0 sends it: the version the batch trains at, the learning rate, the batch."""

    version: int
    lr: float
    trajectories: list[Trajectory]


def send_replica(dp: SingleProcess, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 update_config: "UpdateConfig", off_policy: OffPolicyConfig, pad_token_id: int,
                 temperature: float = 1.0) -> None:
    """Rank 0's half of :func:`rollopt.trainer.torchrun.follow`'s start (nothing to do in one process)."""
    if not isinstance(dp, DataParallel):
        return
    dp.broadcast_parameters(model)
    dp.broadcast_object(Replica(type(optimizer), optimizer.state_dict(), update_config, off_policy, pad_token_id,
                                  temperature))


def init_from_env(backend: str | None = None, timeout_s: float = 6 * 3600) -> DataParallel:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``);
    ``backend`` defaults to ``nccl`` with CUDA, else ``gloo``. ``timeout_s`` bounds every collective, including
    the other ranks' wait for rank 0's next order while it rolls out (torch's default, 30 min, can be too short)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"not started by torchrun (no {', '.join(missing)} in the environment); "
                          "run `torchrun --nproc-per-node N ...`")
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"),
                            timeout=timedelta(seconds=timeout_s))
    return DataParallel()
