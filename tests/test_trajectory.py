import copy
import math

import numpy as np
import pytest
import torch

from rollopt import ErrorRecord, Status, TokenKind, TokenSpan, ToolCall, ToolResult, Trajectory, Turn, collate
from rollopt.storage import load_trajectories, save_trajectories


def make_traj(tid="t0", group="g0") -> Trajectory:
    traj = Trajectory.start(tid, "task0", group, [1, 2, 3])
    s, e = traj.append(TokenSpan.generated([4, 5], [-0.1, -0.2], [0, 0]))
    o0, o1 = traj.append(TokenSpan.observation([6, 7, 8]))
    traj.append(TokenSpan.generated([9], [-1.5], [1]))
    traj.turns.append(Turn(index=0, gen_start=s, gen_end=e, finish_reason="stop", text="hi",
                           tool_calls=[ToolCall("c0", "calc", {"x": 1})],
                           tool_results=[ToolResult("c0", "calc", "Error: x", ErrorRecord("tool_crash", "boom"), 0.5)],
                           parse_errors=[ErrorRecord("tool_parse", "bad", {"text": "{"})], obs_start=o0, obs_end=o1))
    traj.reward = 1.0
    traj.finish(Status.COMPLETED)
    return traj


def test_every_token_carries_id_logprob_version_kind():
    traj = make_traj()
    assert traj.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert traj.kinds.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 1]
    assert traj.versions.tolist() == [-1, -1, -1, 0, 0, -1, -1, -1, 1]
    assert np.isnan(traj.logprobs[~traj.loss_mask]).all()
    assert traj.logprobs[traj.loss_mask].tolist() == [-0.1, -0.2, -1.5]
    assert traj.loss_mask.tolist() == [k == TokenKind.GENERATED for k in traj.kinds]
    assert traj.prompt_length == 3 and traj.num_generated == 3


@pytest.mark.parametrize("build", [
    lambda: TokenSpan(np.array([1, 2]), np.array([-0.1]), np.array([0, 0]), TokenKind.GENERATED),
    lambda: TokenSpan.generated([1], [float("nan")], [0]),
    lambda: TokenSpan.generated([1], [0.5], [0]),
    lambda: TokenSpan.generated([1], [-0.5], [-1]),
    lambda: TokenSpan(np.array([1]), np.array([-0.3]), np.array([-1]), TokenKind.OBSERVATION),
    lambda: TokenSpan(np.array([1]), np.array([np.nan]), np.array([2]), TokenKind.PROMPT),
    lambda: TokenSpan.prompt([-4]),
])
def test_invalid_spans_are_rejected(build):
    with pytest.raises(ValueError):
        build()


def test_construction_validates_arrays():
    good = make_traj()
    with pytest.raises(ValueError, match="differ in length"):
        Trajectory("x", "t", "g", token_ids=good.token_ids, logprobs=good.logprobs[:-1], versions=good.versions,
                   kinds=good.kinds)
    with pytest.raises(ValueError, match="unknown token kinds"):
        Trajectory("x", "t", "g", token_ids=good.token_ids, logprobs=good.logprobs, versions=good.versions,
                   kinds=np.full(len(good), 7))
    # a placeholder logprob on an observation token must not sneak in through construction either
    lps = good.logprobs.copy()
    lps[5] = -0.3
    with pytest.raises(ValueError, match="logprob NaN"):
        Trajectory("x", "t", "g", token_ids=good.token_ids, logprobs=lps, versions=good.versions, kinds=good.kinds)


def test_append_keeps_earlier_tokens_bit_exact():
    traj = Trajectory.start("a", "t", "g", [1, 2])
    before = traj.token_ids.copy()
    traj.append(TokenSpan.generated([3], [-0.5], [0]))
    assert traj.token_ids[: len(before)].tolist() == before.tolist()


def test_appends_grow_in_place_without_changing_arrays_read_before_or_copies():
    """Appends write into growing buffers; arrays read earlier, shallow copies and deep copies are unaffected."""
    rng = np.random.default_rng(0)
    traj = Trajectory.start("a", "t", "g", [1, 2])
    expected = {"token_ids": [1, 2], "versions": [-1, -1], "kinds": [0, 0]}
    seen, copies = [], []
    for step in range(300):  # past several regrowths of the buffers
        n = int(rng.integers(1, 9))
        ids = rng.integers(0, 1000, n).tolist()
        if step % 2:
            traj.append(TokenSpan.generated(ids, [-0.5] * n, [step] * n))
        else:
            traj.append(TokenSpan.observation(ids))
        expected["token_ids"] += ids
        expected["versions"] += [step] * n if step % 2 else [-1] * n
        expected["kinds"] += [1 if step % 2 else 2] * n
        if step % 37 == 0:
            seen.append((traj.token_ids, traj.token_ids.tolist()))
            copies.append((copy.copy(traj), copy.deepcopy(traj), traj.token_ids.tolist()))
    for name, values in expected.items():
        assert getattr(traj, name).tolist() == values, name
    assert traj.num_generated == int(traj.loss_mask.sum())
    assert all(array.tolist() == values for array, values in seen)
    for shallow, deep, values in copies:  # each copy grows on its own, leaving the original alone
        for clone in (shallow, deep):
            clone.append(TokenSpan.observation([7, 7]))
            assert clone.token_ids.tolist() == values + [7, 7]
    assert traj.token_ids.tolist() == expected["token_ids"]
    traj.finish(Status.TRUNCATED)  # a finished episode keeps its tokens in arrays of their own size
    assert traj.token_ids.tolist() == expected["token_ids"] and traj.token_ids.base is None
    assert all(array.tolist() == values for array, values in seen)


def test_a_prompt_span_is_shared_by_trajectories_without_coupling_them():
    prompt = TokenSpan.prompt([1, 2, 3])
    a, b = (Trajectory.start(tid, "t", "g", prompt) for tid in ("a", "b"))
    a.append(TokenSpan.generated([4], [-0.5], [0]))
    b.append(TokenSpan.observation([9, 9]))
    assert a.token_ids.tolist() == [1, 2, 3, 4] and b.token_ids.tolist() == [1, 2, 3, 9, 9]
    assert prompt.token_ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="prompt span"):
        Trajectory.start("c", "t", "g", TokenSpan.observation([1]))


def test_failed_needs_error():
    traj = Trajectory.start("a", "t", "g", [1])
    with pytest.raises(ValueError):
        traj.finish(Status.FAILED)
    traj.finish(Status.FAILED, ErrorRecord("engine", "down"))
    assert traj.error.kind == "engine"


def test_collate_padded_and_packed():
    a, b = make_traj("a"), Trajectory.start("b", "t", "g", [10, 11])
    b.append(TokenSpan.generated([12], [-0.7], [3]))
    padded = collate([a, b], "padded", pad_token_id=0)
    assert padded.input_ids.shape == (2, 9)
    assert padded.input_ids[1].tolist() == [10, 11, 12, 0, 0, 0, 0, 0, 0]
    assert padded.attention_mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert padded.loss_mask[1].tolist() == [False, False, True] + [False] * 6
    assert padded.versions[1, 2] == 3 and padded.versions[1, 3] == -1
    assert torch.isnan(padded.behavior_logprobs[~padded.loss_mask]).all()
    assert math.isclose(padded.behavior_logprobs[1, 2].item(), -0.7, rel_tol=1e-6)
    packed = collate([a, b], "packed")
    assert packed.input_ids.shape == (1, 12)
    assert packed.cu_seqlens.tolist() == [0, 9, 12]
    assert packed.position_ids[0].tolist() == list(range(9)) + [0, 1, 2]
    assert packed.loss_mask.sum() == padded.loss_mask.sum() == 4
    assert torch.equal(packed.input_ids[0, 9:], padded.input_ids[1, :3])


def test_storage_round_trip_is_exact(tmp_path):
    trajs = [make_traj("a"), make_traj("b", group="g1")]
    failed = Trajectory.start("c", "t", "g", [5])
    failed.finish(Status.FAILED, ErrorRecord("env", "broke", {"turn": 0}))
    trajs.append(failed)
    save_trajectories(tmp_path / "roll", trajs)
    back = load_trajectories(tmp_path / "roll")
    assert len(back) == 3
    for x, y in zip(trajs, back):
        for name in ("token_ids", "versions", "kinds"):
            assert np.array_equal(getattr(x, name), getattr(y, name))
        assert np.array_equal(x.logprobs, y.logprobs, equal_nan=True)
        assert x.turns == y.turns and x.status == y.status and x.error == y.error and x.reward == y.reward
