"""Adapter: a gymnasium-style text environment as a rollopt :class:`~rollopt.step.Environment`.

Any object with ``reset(seed=...) -> (observation, info)`` and ``step(action) -> (observation, reward,
terminated, truncated, info)`` works (duck typing; gymnasium itself is not needed). The model acts through one
tool, ``act(action)``, which steps that trajectory's own copy of the game and returns the observation, the
step's reward, the return so far and the terminated/truncated flags as JSON. The episode ends, with the return
as its reward, when the game terminates or truncates or ``max_turns`` is reached; a turn without an action
abandons the game (reward 0.0).

Each trajectory gets a fresh game from ``make_env()``, reset with its task's seed (so the prompt's first
observation is the one it plays from) on its first ``act``; :meth:`close_episode` drops it (calling its
``close()`` if it has one). Calls of one trajectory are serialized; ``step`` runs in a worker thread.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import anyio

from rollopt.errors import ErrorRecord, ToolFailed
from rollopt.step import Environment, StepOutcome, Task, Tool, ToolContext
from rollopt.toolcalls import ParsedTurn
from rollopt.trajectory import ToolResult


class TextGame(Protocol):
    """The gymnasium ``Env`` interface with text observations and actions."""

    def reset(self, *, seed: int | None = None) -> tuple[Any, dict]: ...

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]: ...


@dataclass
class _Episode:
    game: TextGame | None = None  # made and reset by the trajectory's first act
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    total: float = 0.0
    over: bool = False


class GymTextEnv(Environment):
    """A gymnasium-style text game as an environment.

    Args:
        make_env: builds one game (called once per trajectory and once per task for its first observation).
        instructions: what the prompt says before the first observation.
        max_turns: turns allowed per episode.
        name: the environment's name (default ``"gym"``).
    """

    name = "gym"

    def __init__(self, make_env: Callable[[], TextGame], instructions: str = "Play the game by calling act.",
                 max_turns: int = 16, name: str | None = None) -> None:
        self.make_env, self.instructions, self.max_turns = make_env, instructions, max_turns
        if name is not None:
            self.name = name
        self._episodes: dict[str, _Episode] = {}

    def tasks(self, n: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        out = []
        for i in range(n):
            game_seed = rng.randrange(2 ** 31)
            first, _ = self._first(game_seed)
            out.append(Task(id=f"{self.name}-{seed}-{i}", prompt=f"{self.instructions}\n\n{first}",
                            info={"seed": game_seed}))
        return out

    def _first(self, game_seed: int) -> tuple[Any, dict]:
        game = self.make_env()
        try:
            return game.reset(seed=game_seed)
        finally:
            _close(game)

    def tools(self) -> list[Tool]:
        return [Tool.from_function(self.act, timeout_s=30.0)]

    async def act(self, action: str, context: ToolContext) -> dict:
        """Take one action in the game; returns the new observation, the reward and whether the game is over.

        Args:
            action: the action, as the game's text interface expects it.
        """
        if context.task is None:
            raise ToolFailed(ErrorRecord("no_episode", "act needs an episode (a trajectory and its task)"))
        episode = self._episodes.setdefault(context.trajectory_id, _Episode())
        seed = context.task.info["seed"]
        async with episode.lock:
            if episode.game is None:
                game = self.make_env()
                await anyio.to_thread.run_sync(lambda: game.reset(seed=seed))
                episode.game = game
            if episode.over:
                raise ToolFailed(ErrorRecord("episode_over", "the game is over; give your final answer"))
            obs, reward, terminated, truncated, _ = await anyio.to_thread.run_sync(episode.game.step, action)
            episode.total += float(reward)
            episode.over = bool(terminated or truncated)
        return {"observation": str(obs), "reward": float(reward), "return": episode.total,
                "terminated": bool(terminated), "truncated": bool(truncated)}

    def step(self, task: Task, turn_index: int, parsed: ParsedTurn, results: Sequence[ToolResult]) -> StepOutcome:
        outcome = super().step(task, turn_index, parsed, results)
        last = next((json.loads(r.content) for r in reversed(results) if r.name == "act" and r.ok), None)
        if last is not None and (last["terminated"] or last["truncated"]):
            return StepOutcome(observation=[], done=True, reward=last["return"])
        if outcome.done and last is not None:  # out of turns: the return so far
            return StepOutcome(observation=[], done=True, reward=last["return"])
        return outcome

    def score(self, task: Task, final_text: str) -> float:
        return 0.0

    async def close_episode(self, trajectory_id: str) -> None:
        episode = self._episodes.pop(trajectory_id, None)
        if episode is not None and episode.game is not None:
            _close(episode.game)


def _close(game: TextGame) -> None:
    close = getattr(game, "close", None)
    if callable(close):
        close()
