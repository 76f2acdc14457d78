"""Benchmark workloads: seeded, documented, runnable on the embedded engine and on SGLang.

Synthetic workloads (``tool-heavy``, ``long-tail``, ``branching``) run the real model (real prefill and
decode; lengths set by ``max_new_tokens`` + ``ignore_eos``) and real waits for tools (see
``rollopt.environments.synthetic``). ``calculator`` is the real environment with real tool calls and real
text from SmolLM2-135M-Instruct. The agentic workloads (``rollopt.environments.agentic``: a software-engineering
agent, a search agent, a code-tool task, long-tail reasoning) come from published statistics; on the simulated
engine their agent writes its tool calls into the token stream, on a real engine the calls are planned.
Every shipped workload takes environment options (``-o key=value``), checked against its class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from rollopt.engines.base import SamplingParams
from rollopt.environments import CalculatorEnv, SyntheticEnv
from rollopt.environments.agentic import PROFILES, AgentEnv
from rollopt.errors import ConfigError
from rollopt.step import Environment


@dataclass(frozen=True)
class Workload:
    """``tasks`` × ``group_size`` episodes must come back per step; a policy that preempts gets
    ``extra_groups`` more groups (over-provisioning) and the step returns the first ``tasks`` complete ones."""

    name: str
    description: str
    make_env: Callable[[], Environment]
    tasks: int
    group_size: int
    sampling: SamplingParams
    model: str = "tiny"
    extra_groups: int = 0
    fork: dict[str, int] = field(default_factory=dict)
    max_running: int = 64


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload(
        "tool-heavy",
        "12-16 turns of 8-16 tokens, one tool call per turn with log-normal latency (median 0.25 s, sigma 1): "
        "tool time well above decode time, as in multi-turn tool RL; 16 groups of 4",
        partial(SyntheticEnv, turns=(12, 16), tokens_per_turn=(8, 16), tools_per_turn=1, tool_latency_s=0.25,
                tool_sigma=1.0),
        tasks=16, group_size=4, sampling=SamplingParams(temperature=1.0)),
    Workload(
        "long-tail",
        "1-2 turns of 16-32 tokens, short tools; 10% of tasks decode 30x longer (the last requests dominate)",
        partial(SyntheticEnv, turns=(1, 2), tokens_per_turn=(16, 32), tools_per_turn=1, tool_latency_s=0.02,
                tool_sigma=0.5, long_tail_fraction=0.1, long_tail_factor=30),
        tasks=16, group_size=4, sampling=SamplingParams(temperature=1.0), extra_groups=4),
    Workload(
        "branching",
        "tree rollouts: 3 turns, each episode forks into 4 branches after its first turn",
        partial(SyntheticEnv, turns=(3, 3), tokens_per_turn=(16, 32), tools_per_turn=1, tool_latency_s=0.1,
                tool_sigma=0.8, prompt_words=120),
        tasks=8, group_size=1, sampling=SamplingParams(temperature=1.0),
        fork={"fork_after_turn": 0, "fork_branches": 4}),
    Workload(
        "group-prefix",
        "GRPO groups of 8 sharing a long prompt (single-turn, short answers): prefix sharing at G=8",
        partial(SyntheticEnv, turns=(1, 1), tokens_per_turn=(8, 16), tools_per_turn=0, prompt_words=300),
        tasks=4, group_size=8, sampling=SamplingParams(temperature=1.0)),
    Workload(
        "calculator",
        "the calculator environment (few-shot) with SmolLM2-135M-Instruct: real tool calls, real text",
        partial(CalculatorEnv, difficulty=2, few_shot=True, max_turns=4),
        tasks=4, group_size=4, sampling=SamplingParams(max_new_tokens=64, temperature=0.7), model="smollm2",
        max_running=16),
    *(Workload(p.name, f"{p.description} ({p.default_tasks * p.group_size} trajectories by default; sources in "
                       "rollopt.environments.agentic)",
               partial(AgentEnv, profile=p.name), tasks=p.default_tasks, group_size=p.group_size,
               sampling=SamplingParams(temperature=1.0), max_running=256)
      for p in PROFILES.values()),
]}
"""The shipped workloads. The agentic ones (``swe-agent``, ``search-agent``, ``code-tool``, ``reasoning-tail``)
are sized for the simulated engine at production scale; on a real CPU engine shrink them, e.g.
``--tasks 4 -o token_scale=0.05 -o latency_scale=0.1``."""


def environment_workload(env: Environment | Callable[[], Environment], name: str | None = None, tasks: int = 8,
                         group_size: int = 4, sampling: SamplingParams | None = None, model: str = "tiny",
                         max_running: int = 64) -> Workload:
    """A workload of a user's environment (an instance, or a factory called once per bench run): ``tasks`` ×
    ``group_size`` episodes per step, sampled at temperature 1 (64 tokens a turn unless the environment's
    ``turn_sampling`` says otherwise). A random-init model writes no tool calls: give the environment planned
    calls (``Environment.plans_calls``) to benchmark its tools."""
    make_env = env if callable(env) and not isinstance(env, Environment) else (lambda: env)
    label = name or getattr(env, "name", "") or type(env).__name__
    return Workload(label, f"the {label} environment, {tasks} groups of {group_size}", make_env, tasks, group_size,
                    sampling or SamplingParams(max_new_tokens=64, temperature=1.0), model=model,
                    max_running=max_running)


def get_workload(name: str, env_options: dict[str, Any] | None = None, **overrides: Any) -> Workload:
    """A shipped workload by name, or an environment's (a registered or entry-point name, ``pkg.module:Class``
    or ``file.py:Class``, built with ``env_options``) with the default sizes of :func:`environment_workload`."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if name in WORKLOADS:
        shipped = WORKLOADS[name]
        if env_options:
            from rollopt.plugins import check_call

            make = shipped.make_env
            check_call(make.func, {**make.keywords, **env_options}, f"workload {name!r}")  # type: ignore[attr-defined]
            overrides["make_env"] = partial(make, **env_options)
        return Workload(**{**shipped.__dict__, **overrides})
    from rollopt.environments import ENVIRONMENTS, check_environment_options

    if name not in ENVIRONMENTS and ":" not in name:
        raise ConfigError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}, an environment name, or "
                          "'pkg.module:Class' / 'path/to/file.py:Class'")
    options = dict(env_options or {})
    cls = check_environment_options(name, options)
    base = environment_workload(lambda: cls(**options), name=name)
    return Workload(**{**base.__dict__, **overrides})


def with_trajectories(workload: Workload, trajectories: int, tasks_given: bool = False) -> Workload:
    """``workload`` with ``trajectories`` per step (``rollopt bench --trajectories``): that many over its group
    size groups; a one-line error unless it is a positive multiple of the group size (or if ``--tasks`` was
    given too)."""
    if tasks_given:
        raise ConfigError("give --trajectories or --tasks, not both (trajectories = tasks × group size)")
    if trajectories < 1 or trajectories % workload.group_size:
        raise ConfigError(f"--trajectories {trajectories} is not a positive multiple of {workload.name}'s group size "
                          f"{workload.group_size}; use e.g. {max(1, trajectories // workload.group_size) * workload.group_size}")
    return Workload(**{**workload.__dict__, "tasks": trajectories // workload.group_size})
