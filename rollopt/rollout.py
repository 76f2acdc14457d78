"""Run a batch of episodes: tasks × GRPO group size, each episode its own coroutine, all concurrent, so the
engine batches whatever is decoding while other episodes wait on tools. (Scheduling policies that reorder,
share prefixes and preempt build on this in ``rollopt.schedulers``.)"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import anyio

from rollopt.chat import ChatRenderer
from rollopt.engines.base import Engine, SamplingParams
from rollopt.episode import EpisodeSpec, run_episode
from rollopt.step import Environment, Task
from rollopt.trajectory import Trajectory


def episode_specs(tasks: Sequence[Task], group_size: int, sampling: SamplingParams, seed: int) -> list[EpisodeSpec]:
    """One spec per (task, sample); sample ``j`` of task ``i`` gets sampling seed ``seed·10⁶ + i·G + j``, so a
    seed fixes every request's sampling."""
    specs = []
    for i, task in enumerate(tasks):
        for j in range(group_size):
            sample_seed = seed * 1_000_000 + i * group_size + j
            specs.append(EpisodeSpec(task=task, trajectory_id=f"{task.id}.s{j}", group_id=task.id,
                                     sampling=replace(sampling, seed=sample_seed)))
    return specs


async def run_rollout(env: Environment, engine: Engine, renderer: ChatRenderer, specs: Sequence[EpisodeSpec],
                      max_concurrency: int | None = None) -> list[Trajectory]:
    """Run every episode concurrently (at most ``max_concurrency`` at once); results in ``specs`` order."""
    max_context = (await engine.info()).max_context
    limiter = anyio.CapacityLimiter(max_concurrency or len(specs) or 1)
    out: list[Trajectory | None] = [None] * len(specs)

    async def one(i: int) -> None:
        async with limiter:
            out[i] = await run_episode(env, engine, renderer, specs[i], max_context)

    async with anyio.create_task_group() as tg:
        for i in range(len(specs)):
            tg.start_soon(one, i)
    return [t for t in out if t is not None]
