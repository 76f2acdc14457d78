"""ToolContext (who calls a tool), ToolFailed (a tool's own typed error) and the end-of-episode hook."""

import pytest

from rollopt import (
    ChatRenderer, Environment, ErrorRecord, SamplingParams, ScriptedEngine, Task, ToolCall, ToolContext, ToolFailed,
    episode_specs, execute_tool_call, run_rollout, tool,
)


@tool
async def whoami(greeting: str, context: ToolContext) -> str:
    """Say who is calling.

    Args:
        greeting: a word to start with.
    """
    return f"{greeting} {context.trajectory_id} {context.task.id if context.task else '-'}"


@tool
def refuse(reason: str) -> str:
    """Fail with a typed record."""
    raise ToolFailed(ErrorRecord("quota_exceeded", reason))


def test_the_context_parameter_is_hidden_from_the_model():
    assert whoami.context_param == "context"
    assert whoami.schema["function"]["parameters"]["properties"].keys() == {"greeting"}
    assert whoami.validate_arguments({"greeting": "hi", "context": "forged"}).kind == "bad_arguments"


async def test_context_is_passed_and_tool_failed_keeps_its_kind():
    task = Task(id="t0", prompt="p")
    call = ToolCall("c", "whoami", {"greeting": "hi"})
    result = await execute_tool_call([whoami], call, context=ToolContext("tr", task))
    assert result.content == "hi tr t0"
    outside = await execute_tool_call([whoami], call)
    assert outside.content == "hi  -"
    failed = await execute_tool_call([refuse], ToolCall("c", "refuse", {"reason": "no more"}))
    assert failed.error == ErrorRecord("quota_exceeded", "no more")
    assert failed.content == "Error (quota_exceeded): no more"


class RecordingEnv(Environment):
    """Calls whoami once, then answers; records the episodes it was told were over."""

    name = "recording"
    max_turns = 3

    def __init__(self):
        self.closed: list[str] = []

    def tasks(self, n, seed):
        return [Task(id=f"r{seed}-{i}", prompt="go") for i in range(n)]

    def tools(self):
        return [whoami]

    def score(self, task, final_text):
        return 1.0

    async def close_episode(self, trajectory_id):
        self.closed.append(trajectory_id)


@pytest.mark.parametrize("scheduler", ["sync", "overlap"])
async def test_executor_passes_the_context_and_closes_each_episode_once(tokenizer, scheduler):
    env, renderer = RecordingEnv(), ChatRenderer(tokenizer)
    turns = ['<tool_call>{"name": "whoami", "arguments": {"greeting": "hi"}}</tool_call>', "done"]

    def script(request):
        k = int(request.rid.rsplit(".t", 1)[1].split(".")[0])
        return renderer.encode(turns[min(k, 1)]) + [renderer.end_of_turn_id]

    engine = ScriptedEngine(script, eos_token_id=renderer.end_of_turn_id)
    specs = episode_specs(env.tasks(2, 0), 2, SamplingParams(max_new_tokens=50, temperature=0), seed=0)
    trajs = await run_rollout(env, engine, renderer, specs, scheduler)
    assert sorted(env.closed) == sorted(t.id for t in trajs) and len(env.closed) == 4
    for traj in trajs:
        assert traj.tool_results[0].content == f"hi {traj.id} {traj.task_id}"
