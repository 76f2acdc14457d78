"""Agentic workloads from published statistics: a software-engineering agent, a search agent, a code-tool
reasoning task and single-turn reasoning with a long tail.

An :class:`AgentProfile` is a set of distributions (turns, tokens per turn, tool calls per turn, tool
latencies, observation sizes), each with its source. :class:`AgentEnv` turns a profile into seeded episodes:
every trajectory's plan (how many turns, what each turn writes, which tools it calls, how long each call takes
and how much it returns) is a deterministic function of its task id and its sampling seed, so a seed fixes
the whole workload and every policy sees the same one. A task's difficulty is shared by its GRPO group (its
members' lengths are correlated, as real groups' are), each member adds its own spread.

Two ways to run it:

* **Real engines** (a random-init model writes no tool calls): ``calls="planned"``. Each turn's length is
  fixed by ``max_new_tokens`` with ``ignore_eos``, and the planned calls run after the turn
  (:attr:`Environment.plans_calls`). Tools really wait their latency.
* **The simulated engine**: :meth:`AgentEnv.simulated_model` returns the engine's *script* (the simulated
  engine runs no model; its script decides each request's tokens) and switches the environment to
  ``calls="written"``: the script writes each turn as the agent would — text, then each tool call as
  ``<tool_call>{...}</tool_call>`` where the agent writes it, sometimes several, sometimes text after the last
  call, then EOS — and the executor parses the calls from the token stream like a real model's, so a call can
  start while the rest of the turn decodes. The tools wait in virtual time.

The script finds a request's task, trajectory and turn from what the executor sends (``affinity`` = the
group's task id; the request id, :func:`rollopt.executor.parse_request_id`), and the environment finds the same
plan from the :class:`~rollopt.step.EpisodeContext` its hooks receive. A resumed (preempted) turn continues the
same planned turn from where it stopped.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import anyio

from rollopt.config import SamplingParams
from rollopt.engines.virtual_clock import on_grid
from rollopt.step import Environment, EpisodeContext, Task, Tool, tool
from rollopt.toolcalls import ParsedTurn
from rollopt.trajectory import ToolCall, ToolResult

OBSERVATION_WORD = " the"
"""An observation of ``n`` tokens is this word ``n`` times (one token each in the bundled tokenizers)."""
CALL_BUDGET = 96
"""Tokens a turn's budget reserves per written tool call (a call's JSON is ~46 tokens in the tiny tokenizer)."""


@dataclass(frozen=True)
class LogNormal:
    """A log-normal draw ``median · exp(N(0, sigma))``, clipped to ``[low, high]``."""

    median: float
    sigma: float
    low: float = 0.0
    high: float = math.inf

    def draw(self, rng: random.Random, scale: float = 1.0) -> float:
        return min(self.high, max(self.low, self.median * scale * math.exp(rng.gauss(0.0, self.sigma))))

    @property
    def mean(self) -> float:
        """The mean before clipping."""
        return self.median * math.exp(self.sigma ** 2 / 2)


@dataclass(frozen=True)
class AgentProfile:
    """The statistics of one kind of agentic episode (token counts in tokens, latencies in seconds)."""

    name: str
    description: str
    sources: tuple[str, ...]
    tools: tuple[str, ...]
    """Tool names the agent calls (each waits its planned latency and returns its planned observation)."""
    system_tokens: int
    """A system prompt every task shares (tool descriptions, instructions)."""
    prompt_tokens: LogNormal
    """The task's own prompt (the issue, the question), shared by its group."""
    turns: LogNormal
    """Turns per episode (rounded), times the task's difficulty; the last turn calls no tool."""
    think_tokens: LogNormal
    """Tokens a tool turn writes before its first call."""
    calls_per_turn: tuple[float, ...]
    """Probabilities of 1, 2, 3, ... calls in a tool turn (several calls of one turn run in parallel)."""
    tool_latency_s: LogNormal
    observation_tokens: LogNormal
    """Tokens one call returns."""
    after_call: float
    """Probability a tool turn writes text after its last call (decoded while the calls run)."""
    after_tokens: LogNormal
    final_tokens: LogNormal
    """Tokens of the last turn (the answer, the patch)."""
    task_sigma: float
    """Log-scale spread of a task's difficulty (multiplies its turns and tokens; shared by its group)."""
    group_size: int
    default_tasks: int
    max_turns: int
    max_context: int


PROFILES: dict[str, AgentProfile] = {p.name: p for p in (
    AgentProfile(
        "swe-agent",
        "software-engineering agent: ~11 turns (tail past 50), contexts to 32k, multi-second tools with a heavy "
        "tail, sometimes several calls a turn; groups of 8",
        ("Continuum (arXiv 2511.02230): 10.9 turns per episode on SWE-bench agent traces",
         "TraceLab (arXiv 2606.30560): coding-agent sessions average 1.2 tool calls per LLM step "
         "(430k calls / 350k steps)",
         "SWE-agent / OpenHands tool outputs (file views, test logs): hundreds to thousands of tokens",
         "contexts to 32k tokens: the agentic-RL setups of SkyRL R2E-Gym and ThunderAgent (arXiv 2602.13692)"),
        tools=("bash", "edit", "search"), system_tokens=1200,
        prompt_tokens=LogNormal(600, 0.5, 100, 4000),
        turns=LogNormal(8.5, 0.7, 1, 64),
        think_tokens=LogNormal(120, 0.8, 8, 2000),
        calls_per_turn=(0.83, 0.13, 0.04),
        tool_latency_s=LogNormal(2.0, 1.1, 0.1, 300.0),
        observation_tokens=LogNormal(350, 1.0, 10, 4000),
        after_call=0.25, after_tokens=LogNormal(30, 0.6, 4, 400),
        final_tokens=LogNormal(300, 0.7, 16, 3000),
        task_sigma=0.45, group_size=8, default_tasks=128, max_turns=64, max_context=32768),
    AgentProfile(
        "search-agent",
        "search agent (Search-R1 style): 2-5 turns, ~1 s retrieval calls returning passages; groups of 5",
        ("Search-R1 (arXiv 2503.09516): multi-turn retrieval, 2-5 turns, top-3 passages per call, GRPO n=5",
         "notes/agentic-scale.md: search agents take 2-5 turns with ~1 s retrieval calls"),
        tools=("search",), system_tokens=300,
        prompt_tokens=LogNormal(60, 0.4, 16, 400),
        turns=LogNormal(3.3, 0.3, 2, 5),
        think_tokens=LogNormal(90, 0.6, 8, 800),
        calls_per_turn=(1.0,),
        tool_latency_s=LogNormal(1.0, 0.3, 0.2, 10.0),
        observation_tokens=LogNormal(400, 0.2, 100, 1000),
        after_call=0.0, after_tokens=LogNormal(1, 0),
        final_tokens=LogNormal(60, 0.5, 4, 600),
        task_sigma=0.2, group_size=5, default_tasks=205, max_turns=6, max_context=8192),
    AgentProfile(
        "code-tool",
        "code-interpreter reasoning (ReTool style): long reasoning turns with python calls; tool time ~10x "
        "decode time; groups of 8",
        ("verl issue #2873 (ReTool recipe): tool time about 10x generation time in one multi-turn run",
         "ReTool (arXiv 2504.11536): interleaved code execution during long reasoning, ~4-8 calls per answer"),
        tools=("python",), system_tokens=400,
        prompt_tokens=LogNormal(150, 0.4, 32, 1000),
        turns=LogNormal(5.0, 0.5, 1, 16),
        think_tokens=LogNormal(350, 0.7, 16, 4000),
        calls_per_turn=(1.0,),
        tool_latency_s=LogNormal(12.0, 0.9, 0.5, 300.0),
        observation_tokens=LogNormal(60, 0.8, 4, 1000),
        after_call=0.0, after_tokens=LogNormal(1, 0),
        final_tokens=LogNormal(500, 0.6, 16, 4000),
        task_sigma=0.4, group_size=8, default_tasks=128, max_turns=16, max_context=16384),
    AgentProfile(
        "reasoning-tail",
        "single-turn reasoning with long-tail lengths (log-normal, spread 0.9, to 16k tokens); groups of 16",
        ("Seer (arXiv 2511.14617): the last 10% of requests can take ~50% of rollout time",
         "DAPO / GRPO math recipes: 16 samples per prompt, responses to 16k tokens"),
        tools=(), system_tokens=100,
        prompt_tokens=LogNormal(150, 0.4, 32, 1000),
        turns=LogNormal(1, 0, 1, 1),
        think_tokens=LogNormal(1, 0), calls_per_turn=(1.0,),
        tool_latency_s=LogNormal(0.0, 0), observation_tokens=LogNormal(1, 0),
        after_call=0.0, after_tokens=LogNormal(1, 0),
        final_tokens=LogNormal(1500, 0.9, 32, 16000),
        task_sigma=0.6, group_size=16, default_tasks=64, max_turns=1, max_context=20480),
)}


@dataclass(frozen=True)
class PlannedCall:
    tool: str
    seconds: float
    output_tokens: int

    def arguments(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "output_tokens": self.output_tokens}


@dataclass(frozen=True)
class PlannedTurn:
    """One turn: ``think`` tokens, then ``calls``, then ``after`` tokens (a final turn has no calls)."""

    think: int
    calls: tuple[PlannedCall, ...]
    after: int

    @property
    def budget(self) -> int:
        """The turn's ``max_new_tokens`` when the script writes its calls (room for each call's text and EOS)."""
        return self.think + self.after + CALL_BUDGET * len(self.calls) + 1

    @property
    def planned_tokens(self) -> int:
        """The turn's length when a real model writes it and the calls are planned."""
        return self.think + self.after


def plan_episode(profile: AgentProfile, task_id: str, trajectory_id: str, token_scale: float = 1.0,
                 latency_scale: float = 1.0) -> tuple[PlannedTurn, ...]:
    """The deterministic plan of one trajectory: its task's difficulty (from ``task_id``, shared by the group)
    times its own draws (from ``trajectory_id``)."""
    p = profile
    difficulty = math.exp(random.Random(f"{p.name}/task/{task_id}").gauss(0.0, p.task_sigma))
    rng = random.Random(f"{p.name}/episode/{trajectory_id}")
    n_turns = max(1, min(p.max_turns, round(p.turns.draw(rng, difficulty if p.max_turns > 1 else 1.0))))
    scale = token_scale * math.sqrt(difficulty)

    def tokens(dist: LogNormal) -> int:
        return max(1, round(dist.draw(rng, scale)))

    turns = []
    for k in range(n_turns - 1):
        n_calls = 1 + _choice(rng, p.calls_per_turn)
        calls = tuple(PlannedCall(p.tools[rng.randrange(len(p.tools))],
                                  round(p.tool_latency_s.draw(rng) * latency_scale, 3), tokens(p.observation_tokens))
                      for _ in range(n_calls))
        after = tokens(p.after_tokens) if rng.random() < p.after_call else 0
        turns.append(PlannedTurn(tokens(p.think_tokens), calls, after))
    turns.append(PlannedTurn(tokens(p.final_tokens), (), 0))
    return tuple(turns)


def _choice(rng: random.Random, probabilities: Sequence[float]) -> int:
    u, acc = rng.random() * sum(probabilities), 0.0
    for i, w in enumerate(probabilities):
        acc += w
        if u < acc:
            return i
    return len(probabilities) - 1


def _tool(name: str) -> Tool:
    async def run(seconds: float, output_tokens: int) -> str:
        await anyio.sleep(on_grid(seconds))  # a whole number of virtual-clock ticks: see rollopt.engines.virtual_clock
        return OBSERVATION_WORD * output_tokens

    run.__name__ = name
    run.__doc__ = (f"The {name} tool of a simulated agent: waits its planned latency and returns its planned "
                   "output.\n\nArgs:\n    seconds: how long the call takes.\n    output_tokens: tokens it returns.")
    return tool(timeout_s=3600.0)(run)


class AgentEnv(Environment):
    """Episodes of an :class:`AgentProfile` (see the module docstring).

    Args:
        profile: a name of :data:`PROFILES`.
        calls: ``"planned"`` (real engines: calls attached after each turn) or ``"written"`` (the simulated
            engine's script writes them into the token stream; see :meth:`simulated_model`).
        token_scale, latency_scale: multiply every token count / tool latency (to fit a small engine's context
            or a short CI run; 1 = the published statistics).
    """

    name = "agent"

    def __init__(self, profile: str = "swe-agent", calls: str = "planned", token_scale: float = 1.0,
                 latency_scale: float = 1.0) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown agent profile {profile!r}; known: {sorted(PROFILES)}")
        if calls not in ("planned", "written"):
            raise ValueError(f"calls must be 'planned' or 'written', got {calls!r}")
        if not (token_scale > 0 and latency_scale >= 0):
            raise ValueError("token_scale must be > 0 and latency_scale >= 0")
        self.profile = PROFILES[profile]
        self.calls, self.token_scale, self.latency_scale = calls, token_scale, latency_scale
        self.plans_calls = calls == "planned"
        self.max_turns = self.profile.max_turns
        self.show_tool_schemas = False  # the system prompt stands in for them, at the profile's length
        self._tools = [_tool(name) for name in self.profile.tools]
        self._plans: dict[tuple[str, int], tuple[PlannedTurn, ...]] = {}

    def plan(self, task_id: str, trajectory_id: str) -> tuple[PlannedTurn, ...]:
        """The plan of one trajectory (cached: the script and the environment both ask)."""
        key = (task_id, trajectory_id)
        if (found := self._plans.get(key)) is None:
            found = self._plans[key] = plan_episode(self.profile, task_id, trajectory_id, self.token_scale,
                                                    self.latency_scale)
        return found

    def tools(self) -> list[Tool]:
        return list(self._tools)

    def tasks(self, n: int, seed: int) -> list[Task]:
        p = self.profile
        system = _words(random.Random(f"{p.name}/system"), round(p.system_tokens * self.token_scale))
        out = []
        for i in range(n):
            task_id = f"{p.name}-{seed}-{i}"
            rng = random.Random(f"{p.name}/prompt/{task_id}")
            prompt = _words(rng, round(p.prompt_tokens.draw(rng, self.token_scale)))
            out.append(Task(task_id, f"{system}\n\nTask {task_id}:{prompt}"))
        return out

    def _turn(self, task: Task, context: EpisodeContext | None) -> PlannedTurn | None:
        if context is None:
            return None
        plan = self.plan(task.id, context.trajectory_id)
        return plan[context.turn_index] if context.turn_index < len(plan) else None

    def turn_sampling(self, task: Task, turn_index: int, sampling: SamplingParams,
                      context: EpisodeContext | None = None) -> SamplingParams:
        turn = self._turn(task, context)
        if turn is None:
            return sampling
        if self.plans_calls:
            return replace(sampling, max_new_tokens=turn.planned_tokens, ignore_eos=True)
        return replace(sampling, max_new_tokens=turn.budget, ignore_eos=False)

    def calls_for_turn(self, task: Task, turn_index: int, parsed: ParsedTurn,
                       context: EpisodeContext | None = None) -> list[ToolCall]:
        if not self.plans_calls:
            return parsed.tool_calls
        turn = self._turn(task, context)
        return [ToolCall(f"plan.t{turn_index}.c{j}", c.tool, c.arguments())
                for j, c in enumerate(turn.calls if turn is not None else ())]

    def simulated_model(self, tokenizer: Any) -> Callable[[Any], list[int]]:
        """Switch to ``calls="written"`` and return the simulated engine's script: request -> the tokens the
        agent writes (see the module docstring), its text one word repeated (:data:`OBSERVATION_WORD`) around
        the calls, then EOS. Requests that are no trajectory's turn get ``max_new_tokens`` of that word."""
        from rollopt.executor import parse_request_id

        filler_token = tokenizer.encode(OBSERVATION_WORD, add_special_tokens=False)[0]
        eos_token_id = tokenizer.eos_token_id
        self.calls, self.plans_calls = "written", False
        encoded: dict[str, list[int]] = {}

        def call_tokens(call: PlannedCall) -> list[int]:
            text = "<tool_call>" + json.dumps({"name": call.tool, "arguments": call.arguments()}) + "</tool_call>"
            if (ids := encoded.get(text)) is None:
                ids = encoded[text] = list(tokenizer.encode(text, add_special_tokens=False))
            return ids

        def script(request: Any) -> list[int]:
            parsed = parse_request_id(request.rid)
            n = request.sampling.max_new_tokens
            if parsed is None or request.affinity is None:
                return [filler_token] * n
            trajectory_id, turn_index, segment = parsed
            plan = self.plan(request.affinity, trajectory_id)
            if turn_index >= len(plan):
                return [eos_token_id]
            turn = plan[turn_index]
            tokens = [filler_token] * turn.think
            for call in turn.calls:
                tokens += call_tokens(call)
            tokens += [filler_token] * turn.after + [eos_token_id]
            already = 0 if segment == 0 else max(0, turn.budget - n)  # a resumed turn continues where it stopped
            return tokens[already:]

        return script

    def score(self, task: Task, final_text: str, context: EpisodeContext | None = None) -> float:
        """1 when the episode took at most the profile's median turns (shorter solutions score higher), else 0:
        a reward correlated with length, so any length bias in what the trainer receives shows in it."""
        turns = len(context.trajectory.turns) if context is not None else 1
        return 1.0 if turns <= self.profile.turns.median else 0.0


def _words(rng: random.Random, n: int) -> str:
    vocabulary = ("the", "a", "of", "and", "to", "in", "is", "it", "for", "on")
    return "".join(" " + vocabulary[rng.randrange(len(vocabulary))] for _ in range(max(0, n)))
