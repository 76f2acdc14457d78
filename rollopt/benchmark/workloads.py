"""Benchmark workloads: seeded, documented, runnable on the embedded engine and on SGLang.

Synthetic workloads (``tool-heavy``, ``long-tail``, ``branching``) run the real model (real prefill and
decode; lengths set by ``max_new_tokens`` + ``ignore_eos``) and real waits for tools (see
``rollopt.environments.synthetic``). ``calculator`` is the real environment with real tool calls and real
text from SmolLM2-135M-Instruct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from rollopt.engines.base import SamplingParams
from rollopt.environments import CalculatorEnv, SyntheticEnv
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
        lambda: SyntheticEnv(turns=(12, 16), tokens_per_turn=(8, 16), tools_per_turn=1, tool_latency_s=0.25,
                             tool_sigma=1.0),
        tasks=16, group_size=4, sampling=SamplingParams(temperature=1.0)),
    Workload(
        "long-tail",
        "1-2 turns of 16-32 tokens, short tools; 10% of tasks decode 30x longer (the last requests dominate)",
        lambda: SyntheticEnv(turns=(1, 2), tokens_per_turn=(16, 32), tools_per_turn=1, tool_latency_s=0.02,
                             tool_sigma=0.5, long_tail_fraction=0.1, long_tail_factor=30),
        tasks=16, group_size=4, sampling=SamplingParams(temperature=1.0), extra_groups=4),
    Workload(
        "branching",
        "tree rollouts: 3 turns, each episode forks into 4 branches after its first turn",
        lambda: SyntheticEnv(turns=(3, 3), tokens_per_turn=(16, 32), tools_per_turn=1, tool_latency_s=0.1,
                             tool_sigma=0.8, prompt_words=120),
        tasks=8, group_size=1, sampling=SamplingParams(temperature=1.0),
        fork={"fork_after_turn": 0, "fork_branches": 4}),
    Workload(
        "group-prefix",
        "GRPO groups of 8 sharing a long prompt (single-turn, short answers): prefix sharing at G=8",
        lambda: SyntheticEnv(turns=(1, 1), tokens_per_turn=(8, 16), tools_per_turn=0, prompt_words=300),
        tasks=4, group_size=8, sampling=SamplingParams(temperature=1.0)),
    Workload(
        "calculator",
        "the calculator environment (few-shot) with SmolLM2-135M-Instruct: real tool calls, real text",
        lambda: CalculatorEnv(difficulty=2, few_shot=True, max_turns=4),
        tasks=4, group_size=4, sampling=SamplingParams(max_new_tokens=64, temperature=0.7), model="smollm2",
        max_running=16),
]}


def get_workload(name: str, **overrides: Any) -> Workload:
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    w = WORKLOADS[name]
    return Workload(**{**w.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
