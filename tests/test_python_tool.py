"""The python_tool environment: seeded problems whose reference programs, run in the sandbox, give the answers;
sessions per trajectory through a rollout, released at each episode's end."""

import json

import anyio

from rollopt import (
    ChatRenderer, SamplingParams, ScriptedEngine, Status, ToolCall, ToolContext, episode_specs, run_rollout,
)
from rollopt.environments import PythonToolEnv, build_environment
from rollopt.environments.sandbox import SandboxLimits, SandboxPool
from rollopt.step import execute_tool_call
from rollopt.testing import check_environment

LIMITS = SandboxLimits(timeout_s=30.0, cpu_s=20, memory_mb=256)


def test_conformance_and_registry():
    assert len(check_environment(PythonToolEnv())) == 7
    assert isinstance(build_environment("python_tool", families=("primes",)), PythonToolEnv)


def test_tasks_cover_every_family_with_integer_answers():
    tasks = PythonToolEnv().tasks(60, seed=1)
    assert {t.info["family"] for t in tasks} == {"primes", "divisible", "fibonacci", "digits", "collatz"}
    assert all(isinstance(t.answer, int) for t in tasks)
    env = PythonToolEnv()
    task = tasks[0]
    assert env.score(task, f"<answer>{task.answer}</answer>") == 1.0
    assert env.score(task, f"<answer>{task.answer + 1}</answer>") == 0.0


async def test_reference_programs_print_the_answers_in_the_sandbox():
    env = PythonToolEnv()
    tasks = env.tasks(10, seed=2)
    async with SandboxPool(2, LIMITS) as pool:
        outputs = [(await pool.run(t.info["solution"])).output for t in tasks]
    assert outputs == [f"{t.answer}\n" for t in tasks]


async def test_without_a_pool_the_tool_fails_with_a_typed_record():
    env = PythonToolEnv()
    result = await execute_tool_call(env.tools(), ToolCall("c", "run_python", {"code": "print(1)"}),
                                     context=ToolContext("t"))
    assert result.error.kind == "sandbox_unavailable"


async def test_sandbox_errors_reach_the_trajectory_with_their_kind():
    async with SandboxPool(1, SandboxLimits(timeout_s=0.5)) as pool:
        env = PythonToolEnv(pool=pool, stateful=False)
        hang = ToolCall("c", "run_python", {"code": "import time; time.sleep(30)"})
        result = await execute_tool_call(env.tools(), hang, context=ToolContext("t"))
    assert result.error.kind == "sandbox_timeout" and "sandbox_timeout" in result.content


async def test_rollout_keeps_state_per_trajectory_and_releases_sessions(tokenizer):
    renderer = ChatRenderer(tokenizer)
    code = ["import os\nx = len(os.listdir('.')) + 40\nopen('mark', 'w').close()", "print(x + len(os.listdir('.')))"]
    turns = [f"<tool_call>{json.dumps({'name': 'run_python', 'arguments': {'code': c}})}</tool_call>" for c in code]
    turns.append("<answer>41</answer>")

    def script(request):
        k = int(request.rid.rsplit(".t", 1)[1].split(".")[0])
        return renderer.encode(turns[min(k, 2)]) + [renderer.end_of_turn_id]

    async with PythonToolEnv(pool_size=2, limits=LIMITS) as env:
        pool = env.pool
        specs = episode_specs(env.tasks(2, 0), 2, SamplingParams(max_new_tokens=100, temperature=0), seed=0)
        trajs = await run_rollout(env, ScriptedEngine(script, eos_token_id=renderer.end_of_turn_id), renderer, specs)
        assert pool.sessions == 0  # every episode's interpreter was released
        with anyio.fail_after(30):
            await pool.wait_ready()
    assert len(trajs) == 4 and all(t.status is Status.COMPLETED for t in trajs)
    for traj in trajs:  # each trajectory saw only its own scratch file and its own variable
        assert [r.content for r in traj.tool_results] == ["(no output)", "41\n"]
