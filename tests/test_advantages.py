import numpy as np
import pytest

from rollopt import Trajectory
from rollopt.trainer import compute_advantages


def group(rewards, gid="g"):
    out = []
    for i, r in enumerate(rewards):
        t = Trajectory.start(f"{gid}{i}", "t", gid, [1])
        t.reward = r
        out.append(t)
    return out


def test_hand_computed_examples():
    trajs = group([1.0, 0.0, 0.0, 1.0]) + group([2.0], gid="h")
    # mean 0.5, unbiased std sqrt(1/3)
    adv = compute_advantages(trajs, "grpo")
    np.testing.assert_allclose(adv[:4], np.array([0.5, -0.5, -0.5, 0.5]) / (np.sqrt(1 / 3) + 1e-6))
    # a group of one: mean 0, std 1, as in verl
    assert adv[4] == pytest.approx(2.0 / (1 + 1e-6))
    np.testing.assert_allclose(compute_advantages(trajs, "dr_grpo"), [0.5, -0.5, -0.5, 0.5, 2.0])
    # RLOO: r_i minus the mean of the others: 1 - 1/3, 0 - 2/3
    np.testing.assert_allclose(compute_advantages(trajs, "rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3, 2.0])


def test_constant_group_gives_zero_not_nan():
    assert compute_advantages(group([1.0, 1.0, 1.0]), "grpo").tolist() == [0.0, 0.0, 0.0]


def test_missing_reward_is_refused():
    trajs = group([1.0, 0.0])
    trajs[1].reward = None
    with pytest.raises(ValueError, match="without a reward"):
        compute_advantages(trajs)
    with pytest.raises(ValueError, match="unknown advantage"):
        compute_advantages(group([1.0]), "ppo?")
