"""Data-parallel training under torchrun: 2 gloo ranks on CPU give the same loss, gradients and weights as one
process on the same batch (within 1e-5) for every loss aggregation; the training loop under torchrun matches
one process step by step, with rank 0 alone syncing weights to its engine.

This file is also the torchrun worker: the test runs
``python -m torch.distributed.run --nproc-per-node 2 tests/test_distributed.py OUT`` and compares what each
rank wrote to OUT with :func:`train_case` run here in one process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch

from rollopt.trainer.losses import LOSS_AGGREGATIONS

GROUP_SIZES = (4, 4, 3)  # 11 rows: the 2 minibatches (6 + 5 rows) split 3/3 and 2/3 over 2 ranks
TOLERANCE = 1e-5


def make_trajectories(seed: int = 0):
    """Groups of scored trajectories with random prompts, generated tokens, behavior logprobs (versions 0/1)."""
    from rollopt.trajectory import Status, TokenSpan, Trajectory

    rng = np.random.default_rng(seed)
    out = []
    for g, size in enumerate(GROUP_SIZES):
        prompt = rng.integers(5, 500, rng.integers(3, 7)).tolist()
        for j in range(size):
            t = Trajectory.start(f"g{g}.s{j}", f"task{g}", f"g{g}", prompt)
            n = int(rng.integers(2, 9))
            t.append(TokenSpan.generated(rng.integers(5, 500, n).tolist(), (-rng.random(n) * 3).tolist(),
                                         rng.integers(0, 2, n).tolist()))
            t.reward = float(rng.integers(0, 2))
            t.finish(Status.COMPLETED)
            out.append(t)
    return out


def train_case(loss_agg: str, trajectories, data_parallel=None) -> dict[str, Any]:
    """One policy update of a seeded tiny model (2 minibatches, micro-batches of 2 rows): metrics, the last
    minibatch's (clipped, reduced) gradients and the updated weights."""
    from rollopt.modeling.tiny import build_model
    from rollopt.trainer.offpolicy import OffPolicyConfig
    from rollopt.trainer.update import UpdateConfig, policy_update

    model = build_model(512, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                        init_scale=0.3, seed=3 if data_parallel is None else 3 + data_parallel.rank)
    if data_parallel is not None:
        data_parallel.broadcast_parameters(model)  # rank 1 was built with other weights: rank 0's win
    # SGD: the step is linear in the gradient, so equal gradients show as equal weights. (AdamW's first step,
    # g / (|g| + eps), turns a 1e-9 float-order difference in a gradient near eps into ~1e-5 in the weights.)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = UpdateConfig(loss_agg=loss_agg, minibatches=2, micro_batch=2, grad_clip=1.0)
    metrics = policy_update(model, optimizer, trajectories, 1, config, OffPolicyConfig(correction="tis"),
                            data_parallel=data_parallel)
    return {"metrics": metrics, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def worker(out: Path) -> None:
    """One torchrun rank: train every case on its shard of rank 0's batch; write what it got."""
    from rollopt.trainer.distributed import init_from_env

    dp = init_from_env("gloo")
    trajectories = dp.broadcast_object(make_trajectories() if dp.rank == 0 else None)
    saved: dict[str, Any] = {}
    for mode in LOSS_AGGREGATIONS:
        case = train_case(mode, trajectories, dp)
        saved[mode] = {k: case[k] for k in ("metrics", "grads", "params")}
    torch.save(saved, out / f"rank{dp.rank}.pt")
    torch.distributed.destroy_process_group()


def run_torchrun(args: list[str]) -> subprocess.CompletedProcess:
    from rollopt.engines.sglang_server import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_gloo_ranks_train_exactly_like_one_process(tmp_path):
    run_torchrun([__file__, str(tmp_path)])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    trajectories = make_trajectories()
    for mode in LOSS_AGGREGATIONS:
        one = train_case(mode, trajectories)
        for rank in ranks:
            two = rank[mode]
            for key in ("loss", "grad_norm", "train_tokens", "clip_frac", "entropy", "ppo_kl"):
                assert abs(two["metrics"][key] - one["metrics"][key]) < TOLERANCE, (mode, key)
            assert max_diff(two["grads"], one["grads"]) < TOLERANCE, mode
            assert max_diff(two["params"], one["params"]) < TOLERANCE, mode
        assert max_diff(ranks[0][mode]["params"], ranks[1][mode]["params"]) == 0  # the ranks never diverge
        print(f"\n{mode}: |loss diff| {abs(ranks[0][mode]['metrics']['loss'] - one['metrics']['loss']):.2e}, "
              f"max |grad diff| {max_diff(ranks[0][mode]['grads'], one['grads']):.2e}, "
              f"max |param diff| {max_diff(ranks[0][mode]['params'], one['params']):.2e}")



async def test_torchrun_training_loop_matches_one_process(tmp_path):
    """``torchrun -m rollopt.trainer.torchrun``: rank 0 rolls out on its engine and syncs weights, rank 1 follows;
    the per-step metrics and the final weights (what rank 0 synced last) match the recipe trained by one process."""
    import json

    from safetensors.torch import load_file

    from rollopt.trainer.loop import Trainer
    from rollopt.trainer.recipe import load_recipe

    recipe = load_recipe(None, [
        "environment.name=synthetic", "environment.options.turns=[1, 2]", "environment.options.tokens_per_turn=[4, 8]",
        "environment.options.tool_latency_s=0.0", "environment.options.prompt_words=6", "rollout.tasks_per_step=3",
        "rollout.group_size=3", "loop.steps=2", "attribution.sequences=0", "algorithm.micro_batch=2",
        "algorithm.minibatches=2", "model.init_scale=0.3"])
    (tmp_path / "recipe.toml").write_text(recipe.to_toml())
    await Trainer(recipe, tmp_path / "one").run()
    done = await anyio.to_thread.run_sync(run_torchrun, ["-m", "rollopt.trainer.torchrun", "--recipe",
                                                         str(tmp_path / "recipe.toml"), "--out", str(tmp_path / "two")])
    assert "rank 0: 2 steps, policy version 2" in done.stdout and "rank 1: 2 updates" in done.stdout
    one, two = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                for run in ("one", "two"))
    assert [r["policy_version"] for r in two] == [r["policy_version"] for r in one] == [1, 2]  # the engine's answer
    for a, b in zip(one, two):  # the same tokens were sampled and trained on at every step
        assert a["train_tokens"] == b["train_tokens"] and a["reward_mean"] == b["reward_mean"]
        # step 1 trains the same weights on the same batch: within 1e-5. From step 2 on the weights differ by
        # float-order noise that AdamW's first step amplifies (~1e-6 relative), so values agree to 1e-5 relative.
        rel = 0.0 if a["step"] == 1 else TOLERANCE
        for key in ("loss", "grad_norm", "entropy", "ppo_kl"):
            assert math.isclose(a[key], b[key], rel_tol=rel, abs_tol=TOLERANCE), (a["step"], key, a[key], b[key])
    weights = [load_file(tmp_path / run / "checkpoints" / "latest" / "model.safetensors") for run in ("one", "two")]
    assert max_diff(*weights) < 1e-4  # 2 AdamW steps on the same batches; float-order noise only
    print(f"\nloop, 2 steps: max |loss diff| {max(abs(a['loss'] - b['loss']) for a, b in zip(one, two)):.2e}, "
          f"max |weight diff| {max_diff(*weights):.2e}")


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
