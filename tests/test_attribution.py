"""Logprob-mismatch attribution on hand-made cases where the split is known exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rollopt.batch import collate
from rollopt.trajectory import TokenSpan, Trajectory
from rollopt.trainer.attribution import WeightHistory, attribute_mismatch
from rollopt.trainer.scoring import score
from rollopt.trainer.update import Tempered

TEMPERATURE = 0.8


def _weights(model: torch.nn.Module, noise: float, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v.detach().clone() + noise * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def _logprobs_under(model: torch.nn.Module, weights: dict[str, torch.Tensor], traj: Trajectory) -> np.ndarray:
    scorer = type(model)(model.config).eval()
    scorer.load_state_dict(weights)
    with torch.no_grad():
        lp, _ = score(Tempered(scorer, TEMPERATURE), collate([traj]))
    return lp[0].numpy().astype(np.float64)


def _trajectory(tid: str, version: int, behavior: np.ndarray | None = None) -> Trajectory:
    """Prompt, 5 generated tokens of ``version``, an observation, 3 more generated tokens of ``version + 1``."""
    traj = Trajectory.start(tid, "task", "g", [5, 9, 12, 7])
    traj.append(TokenSpan.generated([20, 21, 22, 23, 24], [-1.0] * 5, [version] * 5))
    traj.append(TokenSpan.observation([30, 31]))
    traj.append(TokenSpan.generated([40, 41, 42], [-1.0] * 3, [version + 1] * 3))
    if behavior is not None:
        traj.logprobs = np.where(traj.loss_mask, behavior, np.nan)
    return traj


@pytest.fixture()
def model(peaked_model) -> torch.nn.Module:
    return peaked_model.eval()


def test_identical_weights_leave_no_lag_and_the_whole_gap_is_numerics(model):
    """The kept version-3 and version-4 weights equal the current (version 5) ones: lag is exactly 0."""
    current = {k: v.detach().clone() for k, v in model.state_dict().items()}
    history = WeightHistory(keep=3)
    for v in (3, 4, 5):
        history.record(v, current)
    exact = _logprobs_under(model, current, _trajectory("t", 3))
    offset = np.where(np.arange(len(exact)) % 2 == 0, 0.25, -0.25)  # the engine's kernels are off by ±0.25
    traj = _trajectory("t", 3, behavior=exact + offset)
    out = attribute_mismatch(model, [traj], 5, history, sequences=4, seed=0, temperature=TEMPERATURE)
    assert out["attribution/tokens"] == 8 and out["attribution/unattributed_tokens"] == 0
    assert out["attribution/lag_abs_dlogp"] == 0.0 and out["attribution/lag_dlogp"] == 0.0
    assert out["attribution/numerics_abs_dlogp"] == pytest.approx(0.25, abs=1e-6)
    assert out["attribution/total_abs_dlogp"] == pytest.approx(0.25, abs=1e-6)


def test_engine_equal_to_trainer_leaves_no_numerics_and_the_whole_gap_is_lag(model):
    """The behavior logprobs are exactly what the trainer computes with the sampling versions' weights."""
    history = WeightHistory(keep=2)
    old = {3: _weights(model, 0.05, 3), 4: _weights(model, 0.05, 4)}
    for v, w in old.items():
        history.record(v, w)
    traj = _trajectory("t", 3)
    behavior = np.where(traj.versions == 3, _logprobs_under(model, old[3], traj), _logprobs_under(model, old[4], traj))
    traj = _trajectory("t", 3, behavior=behavior.astype(np.float32).astype(np.float64))  # as the batch stores them
    out = attribute_mismatch(model, [traj], 5, history, sequences=4, seed=0, temperature=TEMPERATURE)
    assert out["attribution/tokens"] == 8
    assert out["attribution/numerics_abs_dlogp"] == 0.0
    assert out["attribution/lag_abs_dlogp"] == out["attribution/total_abs_dlogp"] > 0.01
    assert out["attribution/lag_dlogp"] == out["attribution/total_dlogp"]


def test_versions_no_longer_kept_are_counted_not_attributed_and_fresh_batches_are_skipped(model):
    history = WeightHistory(keep=1)
    history.record(3, _weights(model, 0.05, 3))
    history.record(4, _weights(model, 0.05, 4))  # evicts version 3
    assert history.versions == [4]
    out = attribute_mismatch(model, [_trajectory("t", 3)], 5, history, sequences=4, seed=0)
    assert out["attribution/tokens"] == 3 and out["attribution/unattributed_tokens"] == 5
    assert attribute_mismatch(model, [_trajectory("t", 3)], 3, history, sequences=4, seed=0) == {}  # nothing stale
    assert attribute_mismatch(model, [_trajectory("t", 3)], 5, history, sequences=0, seed=0) == {}


def test_the_model_is_left_unchanged(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    history = WeightHistory(keep=1)
    history.record(3, _weights(model, 0.1, 3))
    attribute_mismatch(model, [_trajectory("t", 3)], 4, history, sequences=1, seed=0)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
