"""Distributed training, the ``torchrun`` entry point:

    torchrun --nproc-per-node N [--nnodes M --node-rank R --master-addr HOST --master-port PORT] \\
        -m rollopt.trainer.torchrun --recipe RECIPE.toml --out DIR [--resume] [section.key=value ...]

Every rank reads the same recipe. Rank 0 runs :class:`~rollopt.trainer.loop.Trainer` (rollout on the recipe's
engine, e.g. ``rollout.engine = "servers"`` over running SGLang servers; weight sync; metrics; checkpoints) with
its policy updates data-parallel; every other rank :func:`follow` s it (see :mod:`rollopt.trainer.distributed`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import anyio
import torch.distributed as dist

from rollopt.errors import ConfigError
from rollopt.trainer.distributed import DataParallel, Replica, init_from_env
from rollopt.trainer.loop import Trainer, build_trainable
from rollopt.trainer.recipe import Recipe, load_recipe
from rollopt.trainer.update import policy_update


def follow(dp: DataParallel, recipe: Recipe) -> int:
    """A rank other than 0: mirror rank 0's weights and optimizer, then run each update it orders on this rank's
    rows until it sends ``None``. Returns the number of updates run."""
    model, _, _ = build_trainable(recipe)
    dp.broadcast_parameters(model)
    replica: Replica = dp.broadcast_object(None)
    optimizer = replica.optimizer_class(model.parameters())
    optimizer.load_state_dict(replica.optimizer_state)  # hyperparameters and moments: rank 0's
    updates = 0
    while (order := dp.broadcast_object(None)) is not None:
        for group in optimizer.param_groups:
            group["lr"] = order.lr
        policy_update(model, optimizer, order.trajectories, order.version, replica.update_config,
                      replica.off_policy, replica.pad_token_id, dp, replica.temperature)
        updates += 1
    return updates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun ... -m rollopt.trainer.torchrun", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True, help="the TOML recipe (the same file on every node)")
    parser.add_argument("--out", required=True, help="rank 0's output directory")
    parser.add_argument("--resume", action="store_true", help="rank 0 continues from DIR/checkpoints/latest")
    parser.add_argument("--backend", default=None,
                        help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        dp = init_from_env(args.backend)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if dp.rank == 0:
            trainer = Trainer(recipe, Path(args.out), resume=args.resume, data_parallel=dp,
                              progress=lambda msg: print(msg, file=sys.stderr, flush=True))
            rows = anyio.run(trainer.run)
            print(f"rank 0: {len(rows)} steps, policy version {trainer.state.version}", flush=True)
        else:
            print(f"rank {dp.rank}: {follow(dp, recipe)} updates", flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
