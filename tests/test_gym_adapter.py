"""The gymnasium-style adapter, with a small text game written here (gymnasium itself is not needed)."""

import random

from rollopt import (
    ChatRenderer, SamplingParams, ScriptedEngine, Status, ToolCall, ToolContext, episode_specs, parse_tool_calls,
    run_rollout,
)
from rollopt.environments import GymTextEnv
from rollopt.step import execute_tool_call
from rollopt.testing import check_environment


class GuessGame:
    """Guess a secret number from 1 to 5; each wrong guess costs 0.1; three wrong guesses end the game."""

    closed = 0

    def reset(self, *, seed=None):
        self.secret, self.guesses = random.Random(seed).randint(1, 5), 0
        return "I picked a number from 1 to 5.", {}

    def step(self, action):
        self.guesses += 1
        if action.strip() == str(self.secret):
            return "Correct!", 1.0, True, False, {}
        hint = "higher" if action.strip().isdigit() and int(action) < self.secret else "lower"
        return f"No, {hint}.", -0.1, False, self.guesses >= 3, {}

    def close(self):
        GuessGame.closed += 1


def test_conformance():
    assert len(check_environment(GymTextEnv(GuessGame))) == 7


async def test_each_trajectory_plays_its_own_game():
    env = GymTextEnv(GuessGame)
    task = env.tasks(1, seed=0)[0]
    assert task.prompt.endswith("I picked a number from 1 to 5.")
    secret = random.Random(task.info["seed"]).randint(1, 5)
    wrong = str(secret % 5 + 1)
    def act(action, trajectory_id):
        call = ToolCall("c", "act", {"action": action})
        return execute_tool_call(env.tools(), call, context=ToolContext(trajectory_id, task))

    a, b = await act(wrong, "a"), await act(str(secret), "b")
    assert '"return": -0.1' in a.content and '"terminated": true' in b.content
    assert not env.step(task, 0, _parsed(wrong), [a]).done
    outcome = env.step(task, 0, _parsed(str(secret)), [b])
    assert outcome.done and outcome.reward == 1.0
    over = await act("1", "b")
    assert over.error.kind == "episode_over"
    await env.close_episode("a")
    await env.close_episode("b")
    again = await act(wrong, "b")
    assert again.ok and '"return": -0.1' in again.content  # a closed episode's id starts a new game


def _parsed(action):
    return parse_tool_calls(f'<tool_call>{{"name": "act", "arguments": {{"action": "{action}"}}}}</tool_call>')


async def test_rollout_ends_on_termination_or_truncation_with_the_return(tokenizer):
    renderer = ChatRenderer(tokenizer)

    def script(request):  # guess 1, 2, 3, ... one per turn
        k = int(request.rid.rsplit(".t", 1)[1].split(".")[0])
        call = f'<tool_call>{{"name": "act", "arguments": {{"action": "{k + 1}"}}}}</tool_call>'
        return renderer.encode(call) + [renderer.end_of_turn_id]

    env = GymTextEnv(GuessGame, max_turns=8)
    tasks = env.tasks(6, seed=1)
    closed_before = GuessGame.closed
    trajs = await run_rollout(env, ScriptedEngine(script, eos_token_id=renderer.end_of_turn_id), renderer,
                              episode_specs(tasks, 1, SamplingParams(max_new_tokens=60, temperature=0), seed=0))
    secrets = [random.Random(task.info["seed"]).randint(1, 5) for task in tasks]
    assert min(secrets) <= 3 < max(secrets)  # both endings are exercised
    for secret, traj in zip(secrets, trajs):
        assert traj.status is Status.COMPLETED
        if secret <= 3:
            assert len(traj.turns) == secret and abs(traj.reward - (1.0 - 0.1 * (secret - 1))) < 1e-9
        else:  # three wrong guesses: truncated by the game
            assert len(traj.turns) == 3 and abs(traj.reward + 0.3) < 1e-9
    assert GuessGame.closed - closed_before == len(tasks)  # every episode's game was closed
