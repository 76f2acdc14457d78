"""What a rollout runs and what it leaves for the next one: episode specs and the carry-over record.

* :class:`EpisodeSpec` is one episode to start (task, trajectory id, GRPO group, sampling, optional fork).
* :class:`CarryOver` is the public, serializable record of the trajectories a rollout call did not return:
  whole groups, each member either done (its group finished beyond the call's quota) or suspended
  (preempted, with every token it had). It holds no live state (no cancel scopes, request ids or tool
  tasks), so a checkpoint pickles it and :meth:`rollopt.executor.RolloutExecutor.restore_carry` takes it back.

Conservation (DESIGN invariant 5): every trajectory an executor starts is returned by exactly one call, or is
in the carry-over, which the next call resumes and returns first (complete groups lead its quota).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Sequence

from rollopt import seeds
from rollopt.engines.base import SamplingParams
from rollopt.errors import ConfigError
from rollopt.step import Task
from rollopt.toolcalls import ParsedTurn
from rollopt.trajectory import Trajectory



@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run. ``fork_after_turn``/``fork_branches``: after that turn's observation the
    trajectory branches into ``fork_branches`` trajectories sharing its tokens (itself plus clones)."""

    task: Task
    trajectory_id: str
    group_id: str
    sampling: SamplingParams
    fork_after_turn: int | None = None
    fork_branches: int = 1


def episode_specs(tasks: Sequence[Task], group_size: int, sampling: SamplingParams, seed: int,
                  **fork: int) -> list[EpisodeSpec]:
    """One spec per (task, sample); sample ``j`` of task ``i`` gets sampling seed ``seed·10⁶ + i·G + j``, so a
    seed fixes every request's sampling. Task ids must be unique (a group is keyed by its task id)."""
    ids = [task.id for task in tasks]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"duplicate task ids {dup[:5]}: each task of a batch is one GRPO group; give every task "
                          "its own id")
    return [EpisodeSpec(task=task, trajectory_id=f"{task.id}.s{j}", group_id=task.id,
                        sampling=replace(sampling, seed=seed * seeds.SAMPLE + i * group_size + j), **fork)
            for i, task in enumerate(tasks) for j in range(group_size)]


@dataclass(frozen=True)
class CarriedTrajectory:
    """One trajectory waiting for the next rollout call, with what its resumption needs.

    ``stage`` is ``"done"`` (finished; its group was complete beyond the quota), ``"gate"`` (waiting to start
    turn ``turn``), ``"generate"`` (turn ``turn`` is partly decoded from offset ``turn_start``, in
    ``segments`` engine requests so far) or ``"tools"`` (turn ``turn`` is decoded as ``pending``; its tool
    calls run again on resume). ``carry_age``: how many calls it has already been carried over by.
    """

    spec: EpisodeSpec
    trajectory: Trajectory
    stage: str
    turn: int
    carry_age: int
    turn_start: int | None = None
    segments: int = 0
    pending: ParsedTurn | None = None

    @property
    def id(self) -> str:
        return self.trajectory.id

    @property
    def done(self) -> bool:
        return self.stage == "done"


@dataclass(frozen=True)
class CarryOver:
    """The carry-over buffer as a value: whole groups, in the order the next call returns them."""

    trajectories: tuple[CarriedTrajectory, ...] = ()

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self):
        return iter(self.trajectories)

    @property
    def groups(self) -> tuple[str, ...]:
        """Group ids, in order of first appearance."""
        return tuple(dict.fromkeys(t.trajectory.group_id for t in self.trajectories))

    @property
    def complete_groups(self) -> tuple[str, ...]:
        """Groups whose every member is done: the next call returns these first."""
        pending = {t.trajectory.group_id for t in self.trajectories if not t.done}
        return tuple(g for g in self.groups if g not in pending)

    @property
    def age_max(self) -> int:
        return max((t.carry_age for t in self.trajectories), default=0)

    def copy(self) -> "CarryOver":
        """An independent copy (the executor keeps mutating the trajectories it resumes)."""
        return CarryOver(tuple(replace(t, trajectory=copy.deepcopy(t.trajectory), pending=copy.deepcopy(t.pending))
                               for t in self.trajectories))
