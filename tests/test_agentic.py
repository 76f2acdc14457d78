"""The agentic workloads (environments/agentic.py): plans are a deterministic function of task and
trajectory, the environment passes the conformance kit, and on the simulated engine the calls the script
writes into the token stream are parsed, run and answered exactly as planned."""

from __future__ import annotations

import anyio
import pytest
import trio.testing

from rollopt import ChatRenderer, RolloutExecutor, SamplingParams, Status, episode_specs
from rollopt.benchmark.workloads import get_workload
from rollopt.config import SimEngineConfig
from rollopt.engines.sim import SimEngine
from rollopt.engines.sim_cost import model_shape
from rollopt.environments.agentic import CALL_BUDGET, PROFILES, AgentEnv, plan_episode
from rollopt.modeling.tiny import build_tokenizer
from rollopt.schedulers import build_scheduler
from rollopt.testing import check_environment


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_a_plan_is_fixed_by_task_and_trajectory_and_fits_its_budget(name):
    profile = PROFILES[name]
    plan = plan_episode(profile, "t0", "t0/0")
    assert plan == plan_episode(profile, "t0", "t0/0")
    others = {plan_episode(profile, "t0", f"t0/{k}") for k in range(1, 9)}
    assert name == "reasoning-tail" or plan not in others or len(others) > 1
    assert 1 <= len(plan) <= profile.max_turns and plan[-1].calls == ()
    for turn in plan[:-1]:
        assert turn.calls and all(c.tool in profile.tools for c in turn.calls)
    for turn in plan:
        assert turn.budget == turn.think + turn.after + CALL_BUDGET * len(turn.calls) + 1


def test_plans_follow_the_profile_statistics():
    profile = PROFILES["swe-agent"]
    plans = [plan_episode(profile, f"t{i // 8}", f"t{i // 8}/{i % 8}") for i in range(800)]
    turns = sorted(len(p) for p in plans)
    calls = [len(t.calls) for p in plans for t in p[:-1]]
    assert 6 <= turns[len(turns) // 2] <= 12  # Continuum: ~10.9 turns on SWE-bench traces
    assert turns[-1] >= 30  # a long tail
    assert 1.1 <= sum(calls) / len(calls) <= 1.3  # TraceLab: 1.2 calls per step


def test_agent_env_passes_the_conformance_kit_where_it_parses_the_calls():
    """``calls="written"`` (the simulated engine's mode) parses what the model writes, so the kit's malformed-call
    check applies; the planned mode ignores the model's text by design (it runs the plan)."""
    assert check_environment(AgentEnv("search-agent", calls="written", token_scale=0.1, latency_scale=0.0))


def test_shipped_agentic_workloads_take_environment_options():
    workload = get_workload("swe-agent", {"token_scale": 0.1}, tasks=2)
    env = workload.make_env()
    assert isinstance(env, AgentEnv) and env.token_scale == 0.1 and workload.group_size == 8


def test_on_the_simulated_engine_every_written_call_is_parsed_run_and_answered_as_planned():
    tokenizer = build_tokenizer()
    env = AgentEnv("swe-agent", token_scale=0.2, latency_scale=0.1)
    config = SimEngineConfig(model_shape="llama-3.1-8b", max_context=16384)

    async def main():
        engine = SimEngine.from_config(config, model_shape("llama-3.1-8b"), vocab_size=len(tokenizer),
                                       eos_token_ids=(tokenizer.eos_token_id,), tokenizer=tokenizer,
                                       script=env.simulated_model(tokenizer))
        async with engine:
            specs = episode_specs(env.tasks(3, 0), 8, SamplingParams(temperature=1.0), 0)
            executor = RolloutExecutor(env, engine, ChatRenderer(tokenizer), build_scheduler("overlap"),
                                       clock=anyio.current_time)
            return (await executor.run(specs)).trajectories

    trajectories = anyio.run(main, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})
    assert env.calls == "written" and len(trajectories) == 24
    checked = 0
    for traj in trajectories:
        plan = env.plan(traj.task_id, traj.id)
        if traj.status is not Status.COMPLETED:
            continue
        checked += 1
        assert len(traj.turns) == len(plan)
        for turn, planned in zip(traj.turns, plan):
            assert [(c.name, c.arguments) for c in turn.tool_calls] == [(c.tool, c.arguments()) for c in planned.calls]
            assert [r.ok for r in turn.tool_results] == [True] * len(planned.calls)
            observed = [r.content.split().count("the") for r in turn.tool_results]
            assert observed == [c.output_tokens for c in planned.calls]
    assert checked >= 20


def test_the_bench_reports_in_turn_overlap_on_exactly_the_turns_that_can_overlap():
    """The turns whose tools can start inside the turn are the planned ones with several calls or text after the
    last call; ``overlap`` shortens their latency against ``async`` (every token the same), and the bench's line
    names the pair."""
    from rollopt.benchmark.report import in_turn_overlap
    from rollopt.benchmark.runner import BenchRun, bench, engine_config
    from rollopt.benchmark.workloads import get_workload
    from rollopt.engines import run

    workload = get_workload("swe-agent", {"token_scale": 0.2, "latency_scale": 0.1}, tasks=3)
    config = engine_config("sim", workload, model_shape="llama-3.1-8b", max_context=16384)
    report = run(lambda: bench(BenchRun(workload, ("async", "overlap"), repeats=1), config), config)
    env = workload.make_env()
    expected = sum(len(turn.calls) >= 2 or (len(turn.calls) == 1 and turn.after > 0)
                   for task in env.tasks(3, 0) for j in range(8)
                   for turn in env.plan(task.id, f"{task.id}.s{j}"))
    async_, overlap = report["policies"]
    assert async_["overlappable_turns"] == overlap["overlappable_turns"] == expected > 0
    assert async_["tokens_generated"] == overlap["tokens_generated"]
    assert overlap["tool_turn_latency_s"] < async_["tool_turn_latency_s"]
    assert overlap["without_early_tools"] == "async" and "without_early_tools" not in async_
    assert in_turn_overlap(report).startswith(f"in-turn overlap, the {expected} turns with several calls")
