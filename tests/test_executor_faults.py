"""Bad input at the executor's boundary: a failing ``reset`` fails its own trajectories as data, and id
collisions are refused before any work starts (both used to lose the whole batch or return nothing)."""

from __future__ import annotations

import pytest

from rollopt import ChatRenderer, ConfigError, RolloutExecutor, SamplingParams, ScriptedEngine, Status, episode_specs
from rollopt.environments import SyntheticEnv
from rollopt.episodes import EpisodeSpec


class ResetFails(SyntheticEnv):
    """Raises in ``reset`` for one task."""

    def __init__(self, bad_task: str, **kw) -> None:
        super().__init__(**kw)
        self.bad_task = bad_task

    def reset(self, task):
        if task.id == self.bad_task:
            raise KeyError("no such fixture: db.sqlite")
        return super().reset(task)


def engine(tokenizer) -> ScriptedEngine:
    return ScriptedEngine(lambda req: [7] * req.sampling.max_new_tokens, vocab_size=len(tokenizer))


@pytest.mark.parametrize("policy", ["sync", "overlap+prefix+preempt"])
async def test_a_reset_that_raises_fails_only_its_own_group(tokenizer, policy):
    env = ResetFails("syn-0-1", turns=(1, 2), tokens_per_turn=(3, 6), tool_latency_s=0.0)
    specs = episode_specs(env.tasks(4, 0), 2, SamplingParams(temperature=1.0), seed=0)
    result = await RolloutExecutor(env, engine(tokenizer), ChatRenderer(tokenizer), policy).run(specs)
    by_id = {t.id: t for t in result.trajectories}
    assert sorted(by_id) == sorted(s.trajectory_id for s in specs)  # nothing lost
    for j in range(2):
        bad = by_id[f"syn-0-1.s{j}"]
        assert bad.status is Status.FAILED and bad.error.kind == "env" and len(bad) == 0
        assert bad.error.detail["hook"] == "reset" and "db.sqlite" in bad.error.message
    good = [t for t in result.trajectories if t.group_id != "syn-0-1"]
    assert len(good) == 6 and all(t.status is Status.COMPLETED and t.num_generated > 0 for t in good)


async def test_a_reset_failure_counts_as_a_complete_group_toward_the_quota(tokenizer):
    env = ResetFails("syn-0-0", turns=(1, 2), tokens_per_turn=(3, 6), tool_latency_s=0.0)
    specs = episode_specs(env.tasks(3, 0), 2, SamplingParams(temperature=1.0), seed=0)
    executor = RolloutExecutor(env, engine(tokenizer), ChatRenderer(tokenizer), "async")
    result = await executor.run(specs, target_groups=2)
    assert {t.group_id for t in result.trajectories} >= {"syn-0-0"} and len(result.trajectories) == 4
    assert executor.carried_groups == 1


def test_duplicate_task_ids_are_refused_with_the_fix():
    env = SyntheticEnv()
    tasks = env.tasks(2, 0)
    with pytest.raises(ConfigError, match=r"duplicate task ids \['syn-0-0'\].*its own id"):
        episode_specs([tasks[0], tasks[0], tasks[1]], 2, SamplingParams(), seed=0)


async def test_duplicate_trajectory_ids_are_refused_before_any_request(tokenizer):
    env = SyntheticEnv(turns=(1, 1), tokens_per_turn=(3, 3), tool_latency_s=0.0)
    task = env.tasks(1, 0)[0]
    spec = EpisodeSpec(task, "same", task.id, SamplingParams())
    eng = engine(tokenizer)
    with pytest.raises(ConfigError, match="duplicate trajectory ids"):
        await RolloutExecutor(env, eng, ChatRenderer(tokenizer), "async").run([spec, spec])
    assert eng.requests == []


class HookFails(SyntheticEnv):
    """Raises in one hook for one task. For ``score`` the first (cut) turn ends the episode, so the executor
    scores it itself; otherwise the planned turns run through ``calls_for_turn`` and ``step``."""

    def __init__(self, hook: str, bad_task: str, **kw) -> None:
        super().__init__(**kw)
        self.hook, self.bad_task = hook, bad_task
        if hook == "score":
            self.plans_calls, self.end_on_truncated_turn = False, True

    def _maybe_raise(self, hook: str, task_id: str) -> None:
        if hook == self.hook and task_id.startswith(self.bad_task):
            raise RuntimeError(f"{hook} broke")

    def reset(self, task):
        self._maybe_raise("reset", task.id)
        return super().reset(task)

    def turn_sampling(self, task, turn_index, sampling):
        self._maybe_raise("turn_sampling", task.id)
        return super().turn_sampling(task, turn_index, sampling)

    def calls_for_turn(self, task, turn_index, parsed):
        self._maybe_raise("calls_for_turn", task.id)
        return super().calls_for_turn(task, turn_index, parsed)

    def step(self, task, turn_index, parsed, results):
        self._maybe_raise("step", task.id)
        return super().step(task, turn_index, parsed, results)

    def score(self, task, final_text):
        self._maybe_raise("score", task.id)
        return super().score(task, final_text)

    async def close_episode(self, trajectory_id):
        self._maybe_raise("close_episode", trajectory_id)


@pytest.mark.parametrize("hook", ["reset", "turn_sampling", "calls_for_turn", "step", "score", "close_episode"])
async def test_an_exception_from_any_environment_hook_fails_only_its_own_episodes(tokenizer, hook):
    env = HookFails(hook, "syn-0-1", turns=(2, 2), tokens_per_turn=(3, 5), tool_latency_s=0.0)
    specs = episode_specs(env.tasks(3, 0), 2, SamplingParams(temperature=1.0), seed=0)
    result = await RolloutExecutor(env, engine(tokenizer), ChatRenderer(tokenizer), "overlap").run(specs)
    assert sorted(t.id for t in result.trajectories) == sorted(s.trajectory_id for s in specs)
    for t in result.trajectories:
        if t.group_id != "syn-0-1":
            assert t.error is None and "close_episode_error" not in t.metadata
        elif hook == "close_episode":  # the episode's data stands; the failure is noted on it
            assert t.error is None and t.metadata["close_episode_error"].detail["hook"] == "close_episode"
        else:
            assert t.status is Status.FAILED and t.error.kind == "env" and t.error.detail["hook"] == hook
