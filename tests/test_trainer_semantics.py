"""Trainer semantics that must match verl / AReaL: ppo_kl over every minibatch, decoupled PPO's masking cap,
sequence-mean denominators without emptied rows (also split over minibatches, micro-batches and ranks),
sequence-level TIS over kept tokens, single-sample groups, a refused zero temperature, stated clip ranges."""

from __future__ import annotations

import copy
import math
import threading
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

import rollopt.trainer.update as update_module
from rollopt.errors import ConfigError
from rollopt.trainer.advantages import compute_advantages
from rollopt.trainer.distributed import DataParallel
from rollopt.trainer.losses import LOSS_AGGREGATIONS, aggregate_loss
from rollopt.trainer.offpolicy import OffPolicyConfig, correct
from rollopt.trainer.recipe import load_recipe
from rollopt.trainer.update import UpdateConfig, policy_update
from rollopt.trajectory import Status, TokenSpan, Trajectory

REPO = Path(__file__).resolve().parents[1]
NAN = float("nan")


def trajectory(tid: str, group: str, reward: float, rng: np.random.Generator, n: int, version: int) -> Trajectory:
    t = Trajectory.start(tid, f"task-{group}", group, rng.integers(5, 500, 4).tolist())
    t.append(TokenSpan.generated(rng.integers(5, 500, n).tolist(), (-rng.random(n) * 3).tolist(), [version] * n))
    t.reward = reward
    t.finish(Status.COMPLETED)
    return t


def live_group(group: str, seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [trajectory(f"{group}.{j}", group, float(j % 2), rng, int(rng.integers(4, 9)), 3) for j in range(4)]


def tiny_model() -> torch.nn.Module:
    from rollopt.modeling.tiny import build_model

    return build_model(512, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                       init_scale=0.3, seed=3)


# ------------------------------------------------------------------------------------------------- 1. ppo_kl
def update_recording_kl(monkeypatch, minibatches: int) -> tuple[dict[str, float], list[tuple[float, float, int]]]:
    """One update (one forward per minibatch); the (approx_kl, clip_frac, tokens) each forward measured."""
    seen: list[tuple[float, float, int]] = []
    real = update_module.ppo_policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        out = real(logprobs, old_logprobs, advantages, mask, *args, **kwargs)
        seen.append((out.approx_kl.item(), out.clip_frac.item(), int(mask.sum())))
        return out

    monkeypatch.setattr(update_module, "ppo_policy_loss", recording)
    model = tiny_model()
    trajectories = live_group("a", 0) + live_group("b", 1)
    config = UpdateConfig(minibatches=minibatches, micro_batch=8, grad_clip=1e9)
    metrics = policy_update(model, torch.optim.SGD(model.parameters(), lr=2.0), trajectories, 3, config,
                            OffPolicyConfig("none"))
    return metrics, seen


def test_ppo_kl_is_averaged_over_every_minibatch(monkeypatch):
    metrics, seen = update_recording_kl(monkeypatch, minibatches=2)
    assert len(seen) == 2 and seen[0][0] == pytest.approx(0.0, abs=1e-6)  # minibatch 1: still π_old
    tokens = sum(n for _, _, n in seen)
    assert metrics["ppo_kl"] == pytest.approx(sum(kl * n for kl, _, n in seen) / tokens, rel=1e-6)
    assert metrics["clip_frac"] == pytest.approx(sum(c * n for _, c, n in seen) / tokens, rel=1e-6)
    assert abs(metrics["ppo_kl"]) > 1e-3  # minibatch 2 trains weights the first step moved

    single, seen = update_recording_kl(monkeypatch, minibatches=1)
    assert len(seen) == 1 and single["ppo_kl"] == pytest.approx(0.0, abs=1e-6) and single["clip_frac"] == 0.0


# --------------------------------------------------------------------------------- 2, 4. off-policy corrections
BEHAVIOR = torch.tensor([[NAN, math.log(0.5), math.log(0.5), math.log(0.1)]])
PROXIMAL = torch.tensor([[-9.0, math.log(0.5), math.log(0.9), math.log(0.5)]])  # ρ = 1, 1.8, 5
MASK = torch.tensor([[False, True, True, True]])
VERSIONS = torch.tensor([[-1, 3, 2, 0]])  # current version 3: lags 0, 1, 3


def test_decoupled_cap_masks_tokens_above_it_where_tis_truncates():
    dec = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("decoupled", is_cap=2.0))
    tis = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("tis", is_cap=2.0))
    assert dec.weights[0].tolist() == pytest.approx([0.0, 1.0, 1.8, 0.0], rel=1e-5)  # ρ = 5 > 2: weight 0
    assert tis.weights[0].tolist() == pytest.approx([0.0, 1.0, 1.8, 2.0], rel=1e-5)
    # AReaL keeps a masked token in the loss mask (it still counts in the denominator), with weight 0
    assert torch.equal(dec.mask, MASK) and dec.is_clipped_frac == pytest.approx(1 / 3)
    at_cap = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("decoupled", is_cap=1.8 + 1e-4))
    assert at_cap.weights[0].tolist() == pytest.approx([0.0, 1.0, 1.8, 0.0], rel=1e-5)  # ≤ cap: kept as ρ


def test_sequence_tis_multiplies_only_the_kept_tokens_ratios():
    fix = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("tis-seq", is_cap=2.0, max_staleness=1))
    assert fix.mask[0].tolist() == [False, True, True, False] and fix.stale_dropped == 1
    # Π over the kept tokens: 1 · 1.8 (the dropped token's ρ = 5 would give 9, capped at 2)
    assert fix.weights[0].tolist() == pytest.approx([0.0, 1.8, 1.8, 0.0], rel=1e-5)
    assert fix.is_clipped_frac == 0.0


# ------------------------------------------------------------------------------- 3. sequence-mean denominators
@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_seq_mean_leaves_out_rows_without_tokens(mode):
    loss = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])
    per_row = [3.0, 12.0] if mode == "seq-mean-token-sum" else [1.5, 4.0]
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(sum(per_row) / 2)


class Exchange:
    """An all-gather between threads (stands in for torch.distributed between ranks)."""

    def __init__(self, n: int) -> None:
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n, timeout=120)

    def gather(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


class ThreadRank(DataParallel):
    """:class:`DataParallel`'s row split, with sums and gradient reduction over threads."""

    def __init__(self, rank: int, world_size: int, exchange: Exchange) -> None:
        self.rank, self.world_size, self.group, self.exchange = rank, world_size, None, exchange

    def sum(self, values):
        gathered = self.exchange.gather(self.rank, [float(v) for v in values])
        return [float(sum(col)) for col in zip(*gathered)]

    def reduce_gradients(self, parameters) -> None:
        params = list(parameters)
        grads = self.exchange.gather(self.rank, [p.grad.clone() for p in params])
        for i, p in enumerate(params):
            p.grad = sum(g[i] for g in grads)


def train(trajectories: list[Trajectory], mode: str, micro_batch: int, dp=None, model=None) -> tuple[dict, dict]:
    model = model or tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = UpdateConfig(loss_agg=mode, minibatches=2, micro_batch=micro_batch)
    metrics = policy_update(model, optimizer, trajectories, 3, config, OffPolicyConfig("tis", max_staleness=1),
                            data_parallel=dp)
    return metrics, {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_update(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    for key in ("loss", "grad_norm", "train_tokens", "ppo_kl"):
        assert a[0][key] == pytest.approx(b[0][key], rel=1e-5, abs=1e-6), key
    assert max(float((a[1][k] - b[1][k]).abs().max()) for k in a[1]) < 1e-5


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_rows_emptied_by_staleness_do_not_change_the_update(mode):
    """Two rows whose every token is too stale (lag 3 > max_staleness 1), one in each minibatch: the update equals
    the one on the batch without them, in one process with 2-row micro-batches and over 2 data-parallel ranks."""
    rng = np.random.default_rng(7)
    dead = [trajectory(f"dead.{j}", "dead", float(j), rng, 3, 0) for j in range(2)]  # short: same padded width
    a, b = live_group("a", 0), live_group("b", 1)
    live = a + b
    with_dead = a + [dead[0]] + b + [dead[1]]  # minibatches [0, 5) and [5, 10): the same live rows as [0, 4), [4, 8)
    reference = train(live, mode, micro_batch=16)
    assert_same_update(train(with_dead, mode, micro_batch=2), reference)

    exchange, results = Exchange(2), [None, None]
    models = [tiny_model() for _ in range(2)]  # here: seeding the global RNG in threads would race

    def rank(r: int) -> None:
        results[r] = train(copy.deepcopy(with_dead), mode, 2, ThreadRank(r, 2, exchange), models[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for result in results:
        assert result is not None
        assert_same_update(result, reference)


# ---------------------------------------------------------------------------------------- 5. temperature 0
@pytest.mark.parametrize("value", ["0", "0.0", "-1.0"])
def test_zero_temperature_is_refused_with_the_fix(value):
    with pytest.raises(ConfigError, match=r"rollout\.temperature = -?0|rollout\.temperature = -1") as info:
        load_recipe(None, [f"rollout.temperature={value}"])
    assert "> 0" in str(info.value) and "1.0" in str(info.value) and "\n" not in str(info.value)
    assert load_recipe(None, ["rollout.temperature=0.7"]).rollout.temperature == 0.7


# ---------------------------------------------------------------------------------------- 6. groups of one
def single(reward: float, group: str) -> Trajectory:
    t = Trajectory.start(f"{group}.0", "t", group, [1])
    t.reward = reward
    return t


@pytest.mark.parametrize("estimator,expected", [
    ("grpo", [0.75 / (1 + 1e-6), -2.0 / (1 + 1e-6)]),  # verl: mean 0, std 1
    ("dr_grpo", [0.75, -2.0]),
    ("rloo", [0.75, -2.0]),
])
def test_a_group_of_one_gets_its_reward_as_verl(estimator, expected):
    trajectories = [single(0.75, "x"), single(-2.0, "y")]
    np.testing.assert_allclose(compute_advantages(trajectories, estimator), expected, rtol=1e-12)


# ------------------------------------------------------------------------------------------ 7. clip range
@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_recipe_states_its_clip_range(path):
    algorithm = tomllib.loads(path.read_text())["algorithm"]
    assert (algorithm["eps_low"], algorithm["eps_high"]) == (0.2, 0.28)
    recipe = load_recipe(path)
    assert (recipe.algorithm.eps_low, recipe.algorithm.eps_high) == (0.2, 0.28)
