"""The per-trajectory loop on a scripted engine (scheduling logic only) and on the embedded engine."""

from dataclasses import replace

import numpy as np

from rollopt import (
    ChatRenderer, EngineFailure, GenerateResult, FinishReason, LocalEngine, LocalEngineConfig, SamplingParams,
    ScriptedEngine, Status, TokenKind, run_rollout, episode_specs,
)
from rollopt.environments import CalculatorEnv

SAMPLING = SamplingParams(max_new_tokens=200, temperature=0)


def scripted_turns(renderer, turns):
    """A script that answers turn k with ``turns[k]`` (text), ending each turn with end-of-turn."""
    def script(request):
        k = int(request.rid.rsplit(".t", 1)[1].split(".")[0])
        return renderer.encode(turns[min(k, len(turns) - 1)]) + [renderer.end_of_turn_id]
    return script


def call(expr):
    return f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


async def test_multi_turn_episode_with_tools(tokenizer):
    env = CalculatorEnv(difficulty=1)
    task = env.tasks(1, 0)[0]
    a, b = task.info["steps"][0], task.info["steps"][1]
    first = eval(a)
    op, n = b.split()
    renderer = ChatRenderer(tokenizer)
    turns = [call(a), call(f"{first} {'//' if op == '/' else op} {n}") + " " + call("1 +"), f"<answer>{task.answer}</answer>"]
    engine = ScriptedEngine(scripted_turns(renderer, turns), eos_token_id=renderer.end_of_turn_id)
    [traj] = await run_rollout(env, engine, renderer, episode_specs([task], 1, SAMPLING, seed=0))
    assert traj.status is Status.COMPLETED and traj.reward == 1.0
    assert [len(t.tool_calls) for t in traj.turns] == [1, 2, 0]
    results = traj.tool_results
    assert results[0].content == str(first) and results[1].content == str(task.answer)
    assert results[2].error.kind == "tool_crash"  # "1 +" is not an expression; the episode goes on
    # token bookkeeping: each request's input is exactly the trajectory so far (prefix invariant)
    for k, req in enumerate(engine.requests):
        start = traj.turns[k].gen_start
        assert list(req.input_ids) == traj.token_ids[:start].tolist()
    kinds = traj.kinds
    for turn in traj.turns:
        assert (kinds[turn.gen_start:turn.gen_end] == TokenKind.GENERATED).all()
        if turn.obs_start >= 0:
            assert (kinds[turn.obs_start:turn.obs_end] == TokenKind.OBSERVATION).all()
    assert np.isnan(traj.logprobs[kinds == TokenKind.OBSERVATION]).all()


async def test_malformed_call_is_recorded_and_episode_continues(tokenizer):
    env = CalculatorEnv()
    task = env.tasks(1, 0)[0]
    renderer = ChatRenderer(tokenizer)
    engine = ScriptedEngine(scripted_turns(renderer, ["<tool_call>{oops</tool_call>", "<answer>0</answer>"]),
                            eos_token_id=renderer.end_of_turn_id)
    [traj] = await run_rollout(env, engine, renderer, episode_specs([task], 1, SAMPLING, seed=0))
    assert traj.status is Status.COMPLETED and len(traj.turns) == 2
    assert traj.turns[0].parse_errors[0].kind == "tool_parse"
    observation = tokenizer.decode(traj.token_ids[traj.turns[0].obs_start:traj.turns[0].obs_end].tolist())
    assert "malformed tool call" in observation


class FailingEngine(ScriptedEngine):
    """Fails the second turn after streaming 2 tokens; the failure's partial result holds 3 (a token the
    client received but had not yet yielded), as a dying server would."""

    async def stream(self, request):
        if ".t1." not in request.rid:
            async for chunk in super().stream(request):
                yield chunk
            return
        out = []
        async for chunk in super().stream(replace(request, stream_tokens=None)):  # one token per chunk
            if len(out) == 2:
                partial = GenerateResult(request.rid, out + chunk.token_ids, [-0.5] * 3, [0] * 3,
                                         FinishReason.ABORT, len(request.input_ids), 0)
                raise EngineFailure("connection reset", partial=partial)
            out += chunk.token_ids
            yield chunk


async def test_engine_failure_keeps_tokens_and_fails_only_that_trajectory(tokenizer):
    env = CalculatorEnv()
    tasks = env.tasks(2, 0)
    renderer = ChatRenderer(tokenizer)
    engine = FailingEngine(scripted_turns(renderer, [call("2 * 3"), "<answer>6</answer>"]),
                           eos_token_id=renderer.end_of_turn_id)
    trajs = await run_rollout(env, engine, renderer, episode_specs(tasks, 2, SAMPLING, seed=0), "overlap")
    assert len(trajs) == 4  # nothing dropped
    for traj in trajs:
        assert traj.status is Status.FAILED and traj.error.kind == "engine"
        assert "connection reset" in traj.error.message
        assert traj.num_generated == len(renderer.encode(call("2 * 3"))) + 1 + 3


async def test_rollout_on_the_embedded_engine(tokenizer, peaked_model):
    env = CalculatorEnv()
    renderer = ChatRenderer(tokenizer)
    specs = episode_specs(env.tasks(2, 0), 4, SamplingParams(max_new_tokens=16, temperature=1.0), seed=0)
    engine = LocalEngine(peaked_model.config, peaked_model.state_dict(), LocalEngineConfig(max_running=8, max_context=1024))
    async with engine:
        trajs = await run_rollout(env, engine, renderer, specs)
        again = await run_rollout(env, engine, renderer, specs)
    assert [t.id for t in trajs] == [s.trajectory_id for s in specs]
    assert all(t.status in (Status.COMPLETED, Status.TRUNCATED) for t in trajs)
    # a seed fixes every request's sampling: the same specs give the same tokens
    assert [t.token_ids.tolist() for t in trajs] == [t.token_ids.tolist() for t in again]
    # samples of one group differ (their seeds differ) but share the prompt, which the cache reused
    assert trajs[0].token_ids.tolist() != trajs[1].token_ids.tolist()
    assert engine.stats.cached_tokens > 0
    for t in trajs:
        assert t.versions[t.loss_mask].tolist() == [0] * t.num_generated
        assert (t.logprobs[t.loss_mask] <= 0).all()
