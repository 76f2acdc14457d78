"""rollopt: fast multi-turn, tool-using RL rollouts for LLM post-training that keep learning semantics.

The public API is exactly ``__all__`` (checked by ``tests/test_public_api.py``).
"""

from rollopt.batch import TrainBatch, collate
from rollopt.chat import ChatRenderer
from rollopt.engines.base import (
    Engine,
    EngineFailure,
    EngineInfo,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from rollopt.engines.local import LocalEngine, LocalEngineConfig
from rollopt.engines.scripted import ScriptedEngine
from rollopt.executor import EpisodeSpec, RolloutExecutor, RolloutResult, episode_specs, run_rollout
from rollopt.graph import RolloutGraph
from rollopt.errors import (
    BadRequestError,
    ConfigError,
    EngineError,
    EnvError,
    ErrorRecord,
    RolloptError,
    ToolError,
    ToolFailed,
)
from rollopt.step import Environment, Message, StepOutcome, Task, Tool, ToolContext, execute_tool_call, tool
from rollopt.storage import load_trajectories, save_trajectories
from rollopt.toolcalls import ParsedTurn, ToolCallStream, parse_tool_calls
from rollopt.trajectory import NO_VERSION, Status, TokenKind, TokenSpan, ToolCall, ToolResult, Trajectory, Turn

__version__ = "0.1.0"

__all__ = [
    "NO_VERSION",
    "BadRequestError",
    "ChatRenderer",
    "ConfigError",
    "Engine",
    "EngineError",
    "EngineFailure",
    "EngineInfo",
    "EnvError",
    "Environment",
    "EpisodeSpec",
    "ErrorRecord",
    "FinishReason",
    "GenerateChunk",
    "GenerateRequest",
    "GenerateResult",
    "LocalEngine",
    "LocalEngineConfig",
    "Message",
    "ParsedTurn",
    "RolloptError",
    "RolloutExecutor",
    "RolloutGraph",
    "RolloutResult",
    "SamplingParams",
    "ScriptedEngine",
    "Status",
    "StepOutcome",
    "Task",
    "TokenKind",
    "TokenSpan",
    "Tool",
    "ToolCall",
    "ToolCallStream",
    "ToolContext",
    "ToolError",
    "ToolFailed",
    "ToolResult",
    "TrainBatch",
    "Trajectory",
    "Turn",
    "collate",
    "episode_specs",
    "execute_tool_call",
    "load_trajectories",
    "parse_tool_calls",
    "run_rollout",
    "save_trajectories",
    "tool",
]
