"""rollopt: fast multi-turn, tool-using RL rollouts for LLM post-training that keep learning semantics.

The public API is exactly ``__all__`` (checked by ``tests/test_public_api.py``). Names are imported on first
use (PEP 562), so ``import rollopt.config`` or ``rollopt --help`` does not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "BadRequestError": "rollopt.errors",
    "BenchRun": "rollopt.benchmark.runner",
    "CarryOver": "rollopt.episodes",
    "ChatRenderer": "rollopt.chat",
    "ConfigError": "rollopt.errors",
    "Engine": "rollopt.engines.base",
    "EngineError": "rollopt.errors",
    "EngineFailure": "rollopt.engines.base",
    "EngineInfo": "rollopt.engines.base",
    "EnvError": "rollopt.errors",
    "Environment": "rollopt.step",
    "EpisodeContext": "rollopt.step",
    "EpisodeSpec": "rollopt.executor",
    "ErrorRecord": "rollopt.errors",
    "FinishReason": "rollopt.engines.base",
    "GenerateChunk": "rollopt.engines.base",
    "GenerateRequest": "rollopt.engines.base",
    "GenerateResult": "rollopt.engines.base",
    "LocalEngine": "rollopt.engines.local",
    "LocalEngineConfig": "rollopt.engines.local",
    "Message": "rollopt.step",
    "NO_VERSION": "rollopt.trajectory",
    "ParsedTurn": "rollopt.toolcalls",
    "RolloptError": "rollopt.errors",
    "RolloutExecutor": "rollopt.executor",
    "RolloutGraph": "rollopt.graph",
    "RolloutResult": "rollopt.executor",
    "SamplingParams": "rollopt.engines.base",
    "ScriptedEngine": "rollopt.engines.scripted",
    "Status": "rollopt.trajectory",
    "StepOutcome": "rollopt.step",
    "Task": "rollopt.step",
    "TokenKind": "rollopt.trajectory",
    "TokenSpan": "rollopt.trajectory",
    "Tool": "rollopt.step",
    "ToolCall": "rollopt.trajectory",
    "ToolCallStream": "rollopt.toolcalls",
    "ToolContext": "rollopt.step",
    "ToolError": "rollopt.errors",
    "ToolFailed": "rollopt.errors",
    "ToolResult": "rollopt.trajectory",
    "TrainBatch": "rollopt.batch",
    "Trajectory": "rollopt.trajectory",
    "Turn": "rollopt.trajectory",
    "ValidationConfig": "rollopt.validate",
    "Workload": "rollopt.benchmark.workloads",
    "bench": "rollopt.benchmark.runner",
    "build_engine": "rollopt.engines",
    "collate": "rollopt.batch",
    "environment_workload": "rollopt.benchmark.workloads",
    "episode_specs": "rollopt.executor",
    "execute_tool_call": "rollopt.step",
    "load_trajectories": "rollopt.storage",
    "parse_tool_calls": "rollopt.toolcalls",
    "register_engine": "rollopt.engines",
    "register_environment": "rollopt.environments",
    "register_scheduler": "rollopt.schedulers",
    "run_rollout": "rollopt.executor",
    "save_trajectories": "rollopt.storage",
    "tool": "rollopt.step",
    "validate_policies": "rollopt.validate",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rollopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for n, v in globals().items() if type(v).__name__ == "module"})
