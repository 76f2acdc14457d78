"""Conservation (DESIGN invariant 5): every trajectory the executor starts is returned exactly once or waits in
the carry-over, which stays bounded; the trainer logs where each one went, across a kill and resume too."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

import pytest

from rollopt import ChatRenderer, RolloutExecutor, SamplingParams, ScriptedEngine, episode_specs
from rollopt.environments import SyntheticEnv
from rollopt.episodes import CarryOver
from rollopt.trainer.loop import Trainer
from rollopt.trainer.recipe import load_recipe


def long_tail_env() -> SyntheticEnv:
    return SyntheticEnv(turns=(1, 3), tokens_per_turn=(4, 10), tool_latency_s=0.001, tool_sigma=0.5,
                        long_tail_fraction=0.3, long_tail_factor=6)


def scripted(tokenizer) -> ScriptedEngine:
    """Each request emits its ``max_new_tokens`` (the plan's turn length) one by one, so long turns take longer."""
    return ScriptedEngine(lambda req: [7] * req.sampling.max_new_tokens, vocab_size=len(tokenizer),
                          token_delay_s=0.0002, count_cached_tokens=False)


async def test_a_carried_complete_group_is_returned_by_the_next_call(tokenizer):
    """The issue's repro: 3 groups per call, a quota of 2, three calls, then a call with no new specs. Before
    the fix the last call returned nothing while 6 trajectories sat done in the carry-over."""
    env = long_tail_env()
    executor = RolloutExecutor(env, scripted(tokenizer), ChatRenderer(tokenizer), "async")
    sampling = SamplingParams(temperature=1.0)
    returned: list[str] = []
    for call in range(3):
        result = await executor.run(episode_specs(env.tasks(3, call), 2, sampling, seed=call), target_groups=2)
        assert len(result.trajectories) == 4 and len(result.started) == 6
        returned += [t.id for t in result.trajectories]
        # the complete groups waiting in the carry-over were returned first, ahead of this call's own groups
        assert executor.carried_groups == call + 1
    last = await executor.run([], target_groups=None)
    returned += [t.id for t in last.trajectories]
    assert len(last.trajectories) == 6 and not executor.carry
    assert sorted(returned) == sorted(f"syn-{c}-{i}.s{j}" for c in range(3) for i in range(3) for j in range(2))


@pytest.mark.parametrize("policy", ["sync", "async", "overlap+prefix+preempt", "overlap+kv+preempt"])
async def test_every_started_trajectory_is_returned_exactly_once_over_20_steps(tokenizer, policy):
    """Over-provisioned steps (quota 3 groups, 2 extra) as the trainer runs them: each step adds only as many
    new groups as the carry-over leaves room for. Every started trajectory is returned once, or is in the
    carry-over; the carry-over never holds more than the extra groups, nor anything older than 2 calls."""
    env = long_tail_env()
    executor = RolloutExecutor(env, scripted(tokenizer), ChatRenderer(tokenizer), policy)
    target, extra, group = 3, 2, 3
    started: list[str] = []
    returned: Counter[str] = Counter()
    for step in range(20):
        tasks = env.tasks(target + extra, step)[: target + extra - executor.carried_groups]
        result = await executor.run(episode_specs(tasks, group, SamplingParams(temperature=1.0), seed=step),
                                    target_groups=target)
        started += result.started
        returned.update(t.id for t in result.trajectories)
        carry = executor.carry
        assert len(result.trajectories) == target * group  # the quota, every step
        assert len(carry.groups) <= extra and carry.age_max <= 2
        assert result.carried_groups == len(carry.groups) and result.carried_age_max == carry.age_max
        assert max(returned.values()) == 1  # nothing returned twice
        in_carry = {t.id for t in carry}
        assert set(started) == set(returned) | in_carry and not in_carry & set(returned)
    assert len(started) == len(set(started)) and len(started) >= 20 * target * group
    drained = await executor.run([], target_groups=None)
    returned.update(t.id for t in drained.trajectories)
    assert set(returned) == set(started) and max(returned.values()) == 1 and not executor.carry


async def test_the_carry_over_is_a_public_record_that_survives_pickling(tokenizer):
    """What a checkpoint stores: a CarryOver of plain records, restored into a new executor, which resumes
    the preempted trajectories from their tokens and returns every carried group."""
    env = long_tail_env()
    renderer = ChatRenderer(tokenizer)
    first = RolloutExecutor(env, scripted(tokenizer), renderer, "overlap+preempt")
    specs = episode_specs(env.tasks(6, 0), 2, SamplingParams(temperature=1.0), seed=0)
    result = await first.run(specs, target_groups=2)
    carry = first.carry
    assert isinstance(carry, CarryOver) and len(carry.groups) == 4 and result.preempted > 0
    assert any(not t.done for t in carry) and all(t.carry_age == 0 for t in carry)
    restored = pickle.loads(pickle.dumps(carry))
    tokens_before = {t.id: t.trajectory.num_generated for t in restored}
    second = RolloutExecutor(env, scripted(tokenizer), renderer, "overlap+preempt")
    second.restore_carry(restored)
    resumed = await second.run([], target_groups=None)
    assert sorted(t.id for t in resumed.trajectories) == sorted(tokens_before)
    for t in resumed.trajectories:  # resumed where it stopped: the planned length, no token lost or repeated
        planned = sum(p.tokens for p in next(s.task for s in specs if s.trajectory_id == t.id).info["plan"])
        assert t.num_generated == planned >= tokens_before[t.id]
    assert carry.trajectories[0].trajectory is not restored.trajectories[0].trajectory


RECIPE = """
name = "conserve"
[model]
init_scale = 0.3
[environment]
name = "synthetic"
[environment.options]
turns = [1, 3]
tokens_per_turn = [4, 10]
tool_latency_s = 0.005
prompt_words = 8
long_tail_fraction = 0.3
long_tail_factor = 4
[rollout]
scheduler = "overlap+prefix+preempt"
tasks_per_step = 2
group_size = 4
extra_groups = 2
max_new_tokens = 48
temperature = 1.0
[algorithm]
micro_batch = 16
[off_policy]
correction = "tis"
max_staleness = 1
[loop]
mode = "async"
checkpoint_every = 1
[attribution]
sequences = 0
"""


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _assert_conserved(rows: list[dict], group_size: int, extra_groups: int) -> None:
    started = returned = accounted = 0
    for r in rows:
        started += r["started"]
        returned += r["returned"]
        accounted += r["trained"] + r["dropped/failed_group"] + r["dropped/staleness"]
        assert r["returned"] == r["trained"] + r["dropped/failed_group"] + r["dropped/staleness"]
        assert started == returned + r["carried"], r  # exact, at every step
        assert r["carried_groups"] <= extra_groups and r["carried"] <= extra_groups * group_size
    last = rows[-1]
    assert last["dropped/shutdown"] == last["carried"]
    assert started == accounted + last["dropped/shutdown"]


async def test_training_conserves_across_a_kill_and_resume(tmp_path):
    """Six async steps with over-provisioning and preemption, stopped after step 3 and resumed from its
    checkpoint: the logged accounting conserves over the whole run, carry-over included."""
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(RECIPE)
    out = tmp_path / "run"

    class Killed(Exception):
        pass

    def kill_after_step_3(metrics: dict) -> None:
        if metrics["step"] == 3:
            raise Killed

    with pytest.raises(BaseException) as info:  # anyio wraps it in an exception group
        await Trainer(load_recipe(recipe_path, ["loop.steps=6"]), out, log=kill_after_step_3).run()
    assert info.group_contains(Killed) if isinstance(info.value, BaseExceptionGroup) else info.type is Killed
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]
    await Trainer(load_recipe(recipe_path, ["loop.steps=6"]), out, resume=True).run()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert sum(r["preempted"] for r in rows) > 0 and any(r["carried"] for r in rows)
    _assert_conserved(rows, group_size=4, extra_groups=2)


def test_sync_mode_refuses_over_provisioning():
    """``sync`` promises on-policy tokens: a group finished beyond the quota would be trained a step late."""
    from rollopt.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.extra_groups = 2 with loop.mode = 'sync'.*extra_groups = 0"):
        load_recipe(None, ["loop.mode=sync", "rollout.extra_groups=2"])
