"""One episode, token-in/token-out, against any engine: the per-trajectory loop the schedulers build on.

Per turn: generate from the trajectory's tokens → append the generated tokens (with their logprobs and
versions) → parse tool calls → run them concurrently (each a separate call with its own deadline) → let the
environment turn results into observation messages → append their chat-template delta → repeat.

Failure handling (DESIGN invariant 3): an engine failure keeps the partial tokens it returned and ends the
trajectory as ``failed`` with an ``engine`` error; an environment that raises ends it as ``failed`` with an
``env`` error; a turn cut by ``max_new_tokens``, a prompt that no longer fits the context, or running out of
turns ends it as ``truncated`` (a cut turn is still scored). Nothing raises out of
:func:`run_episode` except cancellation.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import anyio

from rollopt.chat import ChatRenderer
from rollopt.engines.base import Engine, EngineFailure, FinishReason, GenerateRequest, GenerateResult, SamplingParams
from rollopt.errors import EngineError, ErrorRecord
from rollopt.step import Environment, Task, execute_tool_call
from rollopt.toolcalls import parse_tool_calls
from rollopt.trajectory import Status, TokenSpan, ToolResult, Trajectory, Turn


@dataclass(frozen=True)
class EpisodeSpec:
    """Which episode to run: task, ids, and the sampling of every turn."""

    task: Task
    trajectory_id: str
    group_id: str
    sampling: SamplingParams


async def run_tool_calls(env: Environment, calls) -> list[ToolResult]:
    """Run one turn's calls concurrently; results come back in call order."""
    results: list[ToolResult | None] = [None] * len(calls)
    tools = env.tools()

    async def run(i: int) -> None:
        results[i] = await execute_tool_call(tools, calls[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(calls)):
            tg.start_soon(run, i)
    return [r for r in results if r is not None]


def _append_generation(traj: Trajectory, result: GenerateResult) -> tuple[int, int]:
    return traj.append(TokenSpan.generated(result.output_ids, result.logprobs, result.versions))


async def run_episode(env: Environment, engine: Engine, renderer: ChatRenderer, spec: EpisodeSpec,
                      max_context: int) -> Trajectory:
    """Run one episode to a finished :class:`Trajectory` (completed, truncated, aborted or failed)."""
    task = spec.task
    tool_schemas = [t.schema for t in env.tools()]
    traj = Trajectory.start(spec.trajectory_id, task.id, spec.group_id,
                            renderer.prompt(env.reset(task), tool_schemas))
    for turn_index in range(env.max_turns):
        room = max_context - len(traj)
        if room < 1:
            traj.finish(Status.TRUNCATED)
            return traj
        sampling = replace(spec.sampling, max_new_tokens=min(spec.sampling.max_new_tokens, room))
        if sampling.seed is not None:  # a fresh, reproducible stream per turn
            sampling = replace(sampling, seed=sampling.seed + 7919 * turn_index)
        request = GenerateRequest(f"{traj.id}.t{turn_index}", tuple(int(t) for t in traj.token_ids), sampling)
        try:
            result = await engine.generate(request)
        except EngineFailure as exc:
            if exc.partial is not None:
                _append_generation(traj, exc.partial)
            traj.finish(Status.FAILED, ErrorRecord.from_exception("engine", exc, rid=request.rid))
            return traj
        except EngineError as exc:
            traj.finish(Status.FAILED, ErrorRecord.from_exception("engine", exc, rid=request.rid))
            return traj
        gen_start, gen_end = _append_generation(traj, result)
        parsed = parse_tool_calls(renderer.decode(result.output_ids), id_prefix=f"{traj.id}.t{turn_index}.c")
        turn = Turn(index=turn_index, gen_start=gen_start, gen_end=gen_end, finish_reason=result.finish_reason.value,
                    text=parsed.content, tool_calls=parsed.tool_calls, parse_errors=parsed.errors)
        traj.turns.append(turn)
        if result.finish_reason is FinishReason.ABORT:
            traj.finish(Status.ABORTED)
            return traj
        if result.finish_reason is FinishReason.LENGTH:  # a turn cut by max_new_tokens ends the episode
            traj.reward = env.score(task, parsed.content)
            traj.finish(Status.TRUNCATED)
            return traj
        turn.tool_results = await run_tool_calls(env, parsed.tool_calls)
        try:
            outcome = env.step(task, turn_index, parsed, turn.tool_results)
        except Exception as exc:  # the environment broke its contract: the episode fails, its tokens stay
            traj.finish(Status.FAILED, ErrorRecord.from_exception("env", exc, turn=turn_index))
            return traj
        if outcome.done:
            traj.reward = outcome.reward
            traj.reward_components = dict(outcome.reward_components)
            traj.finish(Status.COMPLETED)
            return traj
        last = int(result.output_ids[-1]) if result.output_ids else None
        turn.obs_start, turn.obs_end = traj.append(TokenSpan.observation(renderer.observation(outcome.observation, last)))
    traj.finish(Status.TRUNCATED)
    return traj
