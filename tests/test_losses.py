"""Policy loss, aggregation, off-policy corrections and mismatch metrics against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollopt.errors import ConfigError
from rollopt.trainer.losses import aggregate_loss, ppo_policy_loss
from rollopt.trainer.metrics import mismatch_by_staleness
from rollopt.trainer.offpolicy import OffPolicyConfig, correct

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_ppo_clip_and_dual_clip_by_hand():
    # ratios exp(log r): 1.5 (A>0, clipped to 1.28), 0.5 (A>0, unclipped), 1.5 (A<0: max(-A·1.5, -A·1.28)),
    # 10 (A<0: -A·10 = 10 is dual-clipped to c·|A| = 3)
    old = t([[0.0, 0.0, 0.0, 0.0]])
    new = torch.log(t([[1.5, 0.5, 1.5, 10.0]])).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = ppo_policy_loss(new, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip_c=3.0)
    assert out.loss_per_token.detach()[0].tolist() == pytest.approx([-1.28, -0.5, 1.5, 3.0], abs=1e-6)
    assert out.clip_frac.item() == pytest.approx(0.25) and out.dual_clip_frac.item() == pytest.approx(0.25)
    out.loss_per_token.sum().backward()
    # clipped and dual-clipped tokens carry no gradient; the others −A·r
    assert new.grad[0].tolist() == pytest.approx([0.0, -0.5, 1.5, 0.0], abs=1e-6)


def test_masked_tokens_with_nan_logprobs_never_enter_the_ratio():
    old = t([[NAN, -1.0, NAN]])  # prompt / observation tokens have NaN behavior logprobs
    new = t([[-0.3, -1.2, -5.0]]).requires_grad_()
    adv = t([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[False, True, False]])
    out = ppo_policy_loss(new, old, adv, mask, weights=t([[NAN, 1.0, NAN]]))
    loss = aggregate_loss(out.loss_per_token, mask, "token-mean")
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all()
    assert loss.item() == pytest.approx(-2.0 * math.exp(-0.2), rel=1e-5)  # r = e^-0.2 is inside the clip range
    assert new.grad[0, 0] == 0 and new.grad[0, 2] == 0 and out.approx_kl.item() == pytest.approx(0.2, rel=1e-5)


def test_log_ratio_is_clamped():
    out = ppo_policy_loss(t([[100.0]]), t([[0.0]]), t([[1.0]]), torch.ones(1, 1, dtype=torch.bool), eps_high=1e9,
                          dual_clip_c=None)
    assert out.loss_per_token.item() == pytest.approx(-math.exp(20.0), rel=1e-5)


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),  # 5 tokens
    ("seq-mean-token-sum", ((1 + 2) + (3 + 4 + 5)) / 2),
    ("seq-mean-token-mean", ((1 + 2) / 2 + (3 + 4 + 5) / 3) / 2),
])
def test_aggregations_by_hand(mode, expected):
    loss = t([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert aggregate_loss(loss, mask, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_aggregation_is_invariant_to_micro_batching(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.3
    mask[3] = False  # a row with no token left: not counted by seq-mean (as in verl)
    full = aggregate_loss(loss, mask, mode)
    n_tok, n_seq = int(mask.sum()), int(mask.any(-1).sum())
    parts = sum(aggregate_loss(loss[i:i + 2], mask[i:i + 2], mode, n_tok, n_seq) for i in range(0, 6, 2))
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)
    with pytest.raises(ValueError, match="unknown loss_agg"):
        aggregate_loss(loss, mask, "sum")


def test_grpo_advantages_reach_the_tokens_of_their_trajectory():
    from rollopt.trajectory import TokenSpan, Trajectory
    from rollopt.batch import collate
    from rollopt.trainer.update import token_advantages

    trajs = []
    for i, r in enumerate([1.0, 0.0, 0.0]):
        tr = Trajectory.start(f"t{i}", "task", "g", [1, 2])
        tr.append(TokenSpan.generated([3, 4], [-0.1, -0.2], [0, 0]))
        tr.reward = r
        trajs.append(tr)
    batch = collate(trajs)
    adv = token_advantages(trajs, batch, "grpo")
    std = torch.tensor([1.0, 0.0, 0.0]).std(unbiased=True).item()
    assert adv[:, 0].tolist() == pytest.approx([(1 - 1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)] + [(-1 / 3) / (std + 1e-6)])


# --------------------------------------------------------------------------------------------- corrections
BEHAVIOR = t([[NAN, math.log(0.5), math.log(0.5), math.log(0.1)]])
PROXIMAL = t([[-9.0, math.log(0.5), math.log(0.9), math.log(0.5)]])  # ρ = 1, 1.8, 5
MASK = torch.tensor([[False, True, True, True]])
VERSIONS = torch.tensor([[-1, 3, 2, 0]])  # current version 3: lags 0, 1, 3


def test_truncated_is_token_and_sequence_level():
    fix = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("tis", is_cap=2.0))
    assert fix.weights[0].tolist() == pytest.approx([0.0, 1.0, 1.8, 2.0], rel=1e-5)
    assert fix.is_clipped_frac == pytest.approx(1 / 3) and torch.equal(fix.old_logprobs[0, 1:], PROXIMAL[0, 1:])
    seq = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("tis-seq", is_cap=2.0))
    assert seq.weights[0, 1:].tolist() == pytest.approx([2.0] * 3)  # Π ρ = 9 → capped at 2 for every token
    assert seq.weights[0, 0] == 0


def test_masked_is_decoupled_and_behavior():
    mis = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("mis", mis_low=0.5, mis_high=2.0))
    assert mis.weights[0].tolist() == pytest.approx([0.0, 1.0, 1.8, 0.0], rel=1e-5)
    dec = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("decoupled", is_cap=None))
    assert dec.weights[0].tolist() == pytest.approx([0.0, 1.0, 1.8, 5.0], rel=1e-5)
    beh = correct(BEHAVIOR, None, VERSIONS, MASK, 3, OffPolicyConfig("behavior"))
    assert beh.weights[0].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert beh.old_logprobs[0, 1:].tolist() == pytest.approx(BEHAVIOR[0, 1:].tolist())
    assert beh.old_logprobs[0, 0] == 0  # the NaN was replaced before any arithmetic
    with pytest.raises(ValueError, match="proximal"):
        correct(BEHAVIOR, None, VERSIONS, MASK, 3, OffPolicyConfig("tis"))


def test_staleness_bound_drops_or_downweights():
    drop = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3, OffPolicyConfig("none", max_staleness=1))
    assert drop.mask[0].tolist() == [False, True, True, False] and drop.stale_dropped == 1
    down = correct(BEHAVIOR, PROXIMAL, VERSIONS, MASK, 3,
                   OffPolicyConfig("none", max_staleness=1, stale="downweight", stale_decay=0.5))
    assert down.mask[0].tolist() == MASK[0].tolist() and down.weights[0].tolist() == [0.0, 1.0, 1.0, 0.25]


def test_bad_correction_config_names_the_fix():
    with pytest.raises(ConfigError, match="use one of"):
        OffPolicyConfig("importance")
    with pytest.raises(ConfigError, match="set is_cap"):
        OffPolicyConfig("tis", is_cap=None)
    with pytest.raises(ConfigError, match="max_staleness"):
        OffPolicyConfig(max_staleness=-1)


def test_mismatch_is_bucketed_by_staleness():
    trainer = t([[0.0, math.log(0.5), math.log(0.5) + 0.2, math.log(0.1) - 1.0]])
    m = mismatch_by_staleness(BEHAVIOR, trainer, VERSIONS, MASK, 3)
    assert m["mismatch/lag0/abs_dlogp"] == pytest.approx(0.0, abs=1e-6)
    assert m["mismatch/lag1/k1"] == pytest.approx(-0.2, rel=1e-4)
    assert m["mismatch/lag1/k2"] == pytest.approx(0.02, rel=1e-4)
    assert m["mismatch/lag2plus/k3"] == pytest.approx(math.exp(-1) - 1 + 1, rel=1e-4)
    assert m["staleness/lag0_frac"] == m["staleness/lag1_frac"] == m["staleness/lag2plus_frac"] == pytest.approx(1 / 3)
    assert m["staleness/max"] == 3
