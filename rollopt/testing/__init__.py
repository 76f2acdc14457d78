"""Conformance kit for user environments: ``check_environment(env)`` runs the Environment contract checks and
raises :class:`~rollopt.errors.EnvError` listing every failed one (or returns the names of the passed ones).

Use it in your own test suite::

    from rollopt.testing import check_environment
    def test_my_env():
        check_environment(MyEnv())
"""

from __future__ import annotations

import json
from typing import Callable

import anyio

from rollopt.errors import EnvError
from rollopt.step import Environment, StepOutcome, execute_tool_call
from rollopt.toolcalls import parse_tool_calls
from rollopt.trajectory import ToolCall


def _check_tasks(env: Environment, seed: int) -> None:
    first, again, other = env.tasks(4, seed), env.tasks(4, seed), env.tasks(4, seed + 1)
    assert len(first) == 4, f"tasks(4, seed) returned {len(first)} tasks"
    assert first == again, "tasks(n, seed) is not deterministic in seed"
    assert len({t.id for t in first}) == 4, "task ids are not unique"
    assert first != other, "tasks(n, seed) ignores the seed"


def _check_tools(env: Environment) -> None:
    tools = env.tools()
    assert len({t.name for t in tools}) == len(tools), "tool names are not unique"
    for t in tools:
        fn = t.schema["function"]
        json.dumps(t.schema)
        assert fn["name"] and fn["description"], f"tool {t.name}: empty name or description"
        params = fn["parameters"]
        assert params["type"] == "object", f"tool {t.name}: parameters must be a JSON object schema"
        assert set(params["required"]) <= set(params["properties"]), f"tool {t.name}: required names unknown params"


def _check_reset(env: Environment, seed: int) -> None:
    for task in env.tasks(2, seed):
        messages = env.reset(task)
        assert messages and all("role" in m and "content" in m for m in messages), "reset() must return messages"
        assert messages[-1]["role"] == "user", "reset() must end with a user message"


def _outcome(env: Environment, text: str, turn_index: int, seed: int, results=()) -> StepOutcome:
    task = env.tasks(1, seed)[0]
    outcome = env.step(task, turn_index, parse_tool_calls(text), list(results))
    assert isinstance(outcome, StepOutcome), "step() must return a StepOutcome"
    return outcome


def _check_final_turn(env: Environment, seed: int) -> None:
    outcome = _outcome(env, "I am done.", 0, seed)
    assert outcome.done, "a turn without tool calls must end the episode"
    assert isinstance(outcome.reward, float), "a finished episode needs a float reward"


def _check_malformed_call(env: Environment, seed: int) -> None:
    outcome = _outcome(env, "<tool_call>{not json</tool_call>", 0, seed)
    if env.max_turns > 1:
        assert not outcome.done, "a malformed tool call should be reported back, not end the episode"
        assert outcome.observation, "a malformed tool call must produce an observation naming the error"


def _check_last_turn(env: Environment, seed: int) -> None:
    tool_name = env.tools()[0].name if env.tools() else "none"
    text = f'<tool_call>{{"name": "{tool_name}", "arguments": {{}}}}</tool_call>'
    assert _outcome(env, text, env.max_turns - 1, seed).done, "the last allowed turn must end the episode"


async def _check_bad_tool_input(env: Environment) -> None:
    tools = env.tools()
    bad_calls = [ToolCall("c0", "no_such_tool", {}), *(ToolCall(f"c{i + 1}", t.name, {"__bogus__": object()})
                                                       for i, t in enumerate(tools))]
    for call in bad_calls:
        result = await execute_tool_call(tools, call)
        assert result.error is not None, f"{call.name} with bad input returned no error record"


CHECKS: dict[str, Callable[[Environment, int], None]] = {
    "tasks_seeded": _check_tasks,
    "tools_schema": lambda env, seed: _check_tools(env),
    "reset_contract": _check_reset,
    "final_turn_scored": _check_final_turn,
    "malformed_call_reported": _check_malformed_call,
    "last_turn_ends": _check_last_turn,
    "bad_tool_input_is_a_record": lambda env, seed: anyio.run(_check_bad_tool_input, env),
}


def check_environment(env: Environment, seed: int = 0) -> list[str]:
    """Run every contract check; return the passed names, or raise EnvError listing the failures."""
    failures, passed = [], []
    for name, check in CHECKS.items():
        try:
            check(env, seed)
            passed.append(name)
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
    if failures:
        raise EnvError(f"{type(env).__name__} fails {len(failures)} conformance check(s):\n  " + "\n  ".join(failures))
    return passed
