"""Errors, grouped by the boundary they cross, and the typed record a failure becomes.

Exceptions are for the caller of an API (bad config, an engine that is down); inside a rollout a failure is
turned into an :class:`ErrorRecord` that is stored in the trajectory, so the rest of the rollout goes on and
no token already generated is lost. Cancellation (``BaseException``) is never turned into a record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class RolloptError(Exception):
    """Base of every error rollopt raises on purpose."""


class ConfigError(RolloptError, ValueError):
    """A configuration value is invalid; the message names the field and how to fix it."""


class EngineError(RolloptError):
    """The inference engine failed or rejected a request (unreachable, HTTP error, bad request)."""


class BadRequestError(EngineError, ValueError):
    """A request the engine refuses to run: empty or over-long prompt, unknown token ids, bad sampling."""


class ToolError(RolloptError):
    """A tool call could not be parsed, was invalid, crashed, or ran past its deadline."""


class ToolFailed(ToolError):
    """Raised by a tool to fail with its own typed record (e.g. ``sandbox_timeout``) instead of ``tool_crash``;
    ``content`` is what the model reads (default: ``"Error (<kind>): <message>"``)."""

    def __init__(self, record: "ErrorRecord", content: str | None = None) -> None:
        super().__init__(record.message)
        self.record = record
        self.content = f"Error ({record.kind}): {record.message}" if content is None else content


class EnvError(RolloptError):
    """An environment broke its contract (reset/step returned something invalid or raised)."""


@dataclass(frozen=True)
class ErrorRecord:
    """A failure kept as data.

    Attributes:
        kind: a stable machine-readable category, e.g. ``"tool_parse"``, ``"tool_timeout"``,
            ``"tool_crash"``, ``"unknown_tool"``, ``"bad_arguments"``, ``"engine"``, ``"env"``,
            ``"prompt_too_long"``, ``"bad_tool_result"`` (a tool returned a value JSON cannot encode),
            ``"tool_blocked"`` (an async tool held the event loop without awaiting).
        message: a human-readable explanation that names the problem.
        detail: optional structured context (the offending text, the exception type, ...).
    """

    kind: str
    message: str
    detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_exception(cls, kind: str, exc: BaseException, **detail: Any) -> "ErrorRecord":
        return cls(kind=kind, message=f"{type(exc).__name__}: {exc}", detail={"exception": type(exc).__name__, **detail})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ErrorRecord":
        return cls(kind=data["kind"], message=data["message"], detail=dict(data.get("detail", {})))
