"""The ``lpf`` policy (longest predicted first): its order on hand-built views, and on the simulated engine that it
changes only when trajectories start, never a token, and that with more trajectories than the engine's batch and
lengths shared within a group it ends the step sooner than ``async``."""

from __future__ import annotations

import anyio
import pytest
import trio.testing

from rollopt import ChatRenderer, RolloutExecutor, SamplingParams, episode_specs
from rollopt.config import SimEngineConfig
from rollopt.engines.sim import SimEngine
from rollopt.engines.sim_cost import model_shape
from rollopt.engines.virtual_clock import start_repeatable_run
from rollopt.environments.agentic import AgentEnv
from rollopt.errors import ConfigError
from rollopt.modeling.tiny import build_tokenizer
from rollopt.schedulers import LongestPredictedFirstPolicy, RolloutView, Stage, TrajectoryView, build_scheduler


def entry(tid: str, group: str, stage: Stage = Stage.GATE, generated: int = 0, turn: int = 0) -> TrajectoryView:
    return TrajectoryView(tid, group, turn, stage, generated)


def view(*entries: TrajectoryView, max_running: int | None = 4, now: float = 0.0) -> RolloutView:
    return RolloutView(tuple(entries), now=now, max_running=max_running)


def test_one_probe_per_unstarted_group_goes_first_then_the_group_whose_members_ran_longest():
    entries = (
        entry("a0", "a", Stage.DONE, generated=50, turn=1), entry("a1", "a"),  # a: its probe finished short
        entry("b0", "b", Stage.GENERATE, generated=900), entry("b1", "b"),  # b: its probe still decodes, long
        entry("c0", "c"), entry("c1", "c"),  # c: nobody started
        entry("d0", "d"), entry("d1", "d"),  # d: nobody started
    )
    assert LongestPredictedFirstPolicy().ranking(view(*entries)) == ["c0", "d0", "b1", "a1", "c1", "d1"]
    assert LongestPredictedFirstPolicy().predicted_tokens(view(*entries)) == {"a": 50, "b": 900}


def test_a_trajectory_not_started_waits_only_while_the_engine_batch_is_full_and_only_the_head_goes():
    policy = LongestPredictedFirstPolicy()
    probe_done = entry("a0", "a", Stage.DONE, generated=10, turn=1)
    running = [entry(f"r{i}", "r", Stage.GENERATE, generated=5, turn=1) for i in range(3)]
    waiting = [entry("a1", "a"), entry("n0", "n")]
    v = view(probe_done, *running, *waiting)
    assert v.generating == 3
    assert policy.may_generate(v, "n0") and not policy.may_generate(v, "a1")  # n's probe before a's sibling
    assert list(policy.admission_candidates(v, {"a1", "n0"})) == ["n0"]
    full = v.with_entry(entry("n0", "n", Stage.GENERATE, turn=0), 0.5)
    assert not policy.may_generate(full, "a1") and list(policy.admission_candidates(full, {"a1"})) == []
    started = view(probe_done, *running, entry("s", "r", Stage.GATE, generated=5, turn=1), entry("a1", "a"),
                   entry("n0", "n", Stage.GENERATE))
    assert started.generating == 4 and policy.may_generate(started, "s")  # started: never held, even when full
    freed = full.with_entry(entry("r1", "r", Stage.DONE, generated=5, turn=1), 0.7)
    assert policy.may_generate(freed, "a1")
    assert policy.may_generate(view(*running, *waiting, max_running=None), "a1")  # no batch size reported: async


def test_the_ranking_is_refreshed_after_refresh_s_and_for_a_new_batch():
    """Between refreshes the order stays as ranked (O(1) per admission); after ``refresh_s`` of the rollout's clock
    a group that has since shown a long member moves ahead."""
    policy = LongestPredictedFirstPolicy(refresh_s=1.0)
    started = [entry("a0", "a", Stage.GENERATE, generated=10), entry("b0", "b", Stage.GENERATE, generated=10)]
    waiting = [entry("a1", "a"), entry("b1", "b")]
    v = view(*started, *waiting, max_running=8)
    assert list(policy.admission_candidates(v, {"a1", "b1"})) == ["a1"]  # a tie: batch order
    longer = v.with_entry(entry("b0", "b", Stage.GENERATE, generated=400), 0.5)
    assert list(policy.admission_candidates(longer, {"a1", "b1"})) == ["a1"]  # not yet refreshed
    later = longer.with_entry(entry("b0", "b", Stage.GENERATE, generated=500), 1.5)
    assert list(policy.admission_candidates(later, {"a1", "b1"})) == ["b1"]
    other_batch = view(entry("z0", "z"), entry("z1", "z"), max_running=8)  # a new step: ranked at once
    assert list(policy.admission_candidates(other_batch, {"z0", "z1"})) == ["z0"]


def test_lpf_does_not_combine_with_kv_which_also_orders_admission():
    with pytest.raises(ConfigError, match="pick one"):
        build_scheduler("lpf+kv")
    with pytest.raises(ConfigError, match="pick one"):
        build_scheduler("auto+lpf")
    assert build_scheduler("overlap+lpf").risk_class.value == "R1"
    with pytest.raises(ValueError):
        LongestPredictedFirstPolicy(refresh_s=-1)


def rollout_on_sim(policy, max_running: int, tasks: int):
    """``tasks`` groups of 16 single-turn reasoning answers (lengths to 16k, shared in part by the group) on one
    simulated H200 running ``max_running`` requests at once, the task order seeded."""
    tokenizer = build_tokenizer()
    env = AgentEnv("reasoning-tail", token_scale=0.25)
    config = SimEngineConfig(model_shape="llama-3.1-8b", max_running=max_running, max_context=8192)

    async def main():
        sim = SimEngine.from_config(config, model_shape("llama-3.1-8b"), vocab_size=len(tokenizer),
                                    eos_token_ids=(tokenizer.eos_token_id,), tokenizer=tokenizer,
                                    script=env.simulated_model(tokenizer))
        async with sim as engine:
            specs = episode_specs(env.tasks(tasks, 0), 16, SamplingParams(temperature=1.0), 0)
            await start_repeatable_run(0)
            executor = RolloutExecutor(env, engine, ChatRenderer(tokenizer), policy, clock=anyio.current_time)
            return await executor.run(specs)

    return anyio.run(main, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})


def test_lpf_changes_no_token_and_with_a_queue_ends_the_step_sooner_than_async():
    """16 groups of 16 answers against a 32-row batch: ``async`` sends all 256 and the engine starts them in
    arrival order, so the members of a long group that arrive late run alone at the end."""
    fast, slow = (rollout_on_sim(build_scheduler(name), 32, 16) for name in ("lpf", "async"))
    def tokens(result):
        return {t.id: tuple(t.token_ids) for t in result.trajectories}

    assert tokens(fast) == tokens(slow)  # R1: identical tokens, every trajectory
    assert len(fast.trajectories) == 256 and not any(t.error for t in fast.trajectories)
    assert fast.wall_s < 0.93 * slow.wall_s  # virtual seconds (measured: 33.89 s against 37.62 s, 0.90)
