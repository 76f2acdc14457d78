"""The step interface: how a user's environment plugs into rollopt.

An :class:`Environment` generates seeded :class:`Task` s, gives the initial messages of an episode
(:meth:`Environment.reset`), exposes its tools, and turns one parsed assistant turn plus the results of its
tool calls into observation messages, a reward and a done flag (:meth:`Environment.step`).

Tools are **not** run inside ``step``: each call is a separate coroutine, :func:`execute_tool_call`, so a
scheduler can start it the moment its call is complete in the decode stream, run parallel calls at once and
give each a deadline. ``execute_tool_call`` never raises for a tool's own failure: an unknown tool, bad
arguments, a crash, a timeout, a value JSON cannot encode or an async tool that blocks the event loop becomes
a :class:`~rollopt.trajectory.ToolResult` with a typed ``error``. Cancellation of the caller is never swallowed.
"""

from __future__ import annotations

import abc
import gc
import inspect
import json
import logging
import re
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Sequence, TypedDict, Union

import anyio

from rollopt.config import SamplingParams
from rollopt.errors import ErrorRecord, ToolFailed
from rollopt.toolcalls import ParsedTurn
from rollopt.trajectory import ToolCall, ToolResult

logger = logging.getLogger(__name__)

SLOW_STRETCH_S = 0.1
"""An async tool that holds the event loop this long without awaiting is logged (asyncio's debug threshold)."""


class Message(TypedDict, total=False):
    """An OpenAI-style chat message."""

    role: str
    content: str
    name: str
    tool_call_id: str
    tool_calls: list[dict[str, Any]]


# ----------------------------------------------------------------------------------------------- tools


@dataclass(frozen=True)
class ToolContext:
    """Who is calling a tool. Annotate one tool parameter with this type to receive it; the model neither sees
    nor sets it. A tool keys per-episode state on ``trajectory_id`` (e.g. a sandbox session) and
    :meth:`Environment.close_episode` releases it.

    Attributes:
        trajectory_id: the calling episode (``""`` outside an episode: keep no state then).
        task: the episode's task (``None`` outside an episode).
    """

    trajectory_id: str = ""
    task: "Task | None" = None


_JSON_TYPES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def _json_schema(annotation: Any) -> dict[str, Any]:
    """JSON schema of a Python annotation (str, int, float, bool, list[...], dict, Literal, Optional)."""
    origin = typing.get_origin(annotation)
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if origin is Literal:
        values = typing.get_args(annotation)
        return {"type": _JSON_TYPES[type(values[0])], "enum": list(values)}
    if origin in (list, Sequence, tuple) or annotation is list:
        args = typing.get_args(annotation)
        return {"type": "array", "items": _json_schema(args[0])} if args else {"type": "array"}
    if origin is dict or annotation is dict:
        return {"type": "object"}
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _json_schema(members[0])
        return {"anyOf": [_json_schema(m) for m in members]}
    raise TypeError(f"unsupported tool parameter type {annotation!r}; use str, int, float, bool, list, dict or Literal")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {arg: description})."""
    doc = inspect.cleandoc(doc or "")
    sections = re.split(r"^\s*(Args|Arguments|Parameters|Returns|Raises):\s*$", doc, flags=re.M)
    description = sections[0].strip()
    params: dict[str, str] = {}
    for header, body in zip(sections[1::2], sections[2::2]):
        if header not in ("Args", "Arguments", "Parameters"):
            continue
        current = None
        for line in body.splitlines():
            m = re.match(r"^\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                current = m.group(1)
                params[current] = m.group(3).strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return description, params


def _check_value(value: Any, schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "anyOf" in schema:
        return any(_check_value(value, s) for s in schema["anyOf"])
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list) and all(_check_value(v, schema.get("items", {})) for v in value)
    if kind == "object":
        return isinstance(value, dict)
    return True


@dataclass(frozen=True)
class Tool:
    """A typed Python callable (sync or async) exposed to the model as an OpenAI function tool.

    Attributes:
        fn: the callable; its return value is sent to the model as text (``str`` as is, else JSON).
        name, description, parameters: the OpenAI function schema.
        timeout_s: the deadline of one call.
        deterministic: the same arguments always give the same result (a scheduler may cache it).
        context_param: the parameter annotated :class:`ToolContext`, if any (not in the schema).
        max_blocking_s: an async tool that runs longer than this (or than its deadline) without awaiting has
            blocked the event loop, and with it every other call and decode stream: the call fails with a
            ``tool_blocked`` record. A sync tool runs in a worker thread and cannot block the loop.
    """

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]
    timeout_s: float = 30.0
    deterministic: bool = False
    context_param: str | None = None
    max_blocking_s: float = 1.0

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI tool schema: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None, timeout_s: float = 30.0,
                      deterministic: bool = False, max_blocking_s: float = 1.0) -> "Tool":
        hints = typing.get_type_hints(fn)
        description, arg_docs = _docstring_parts(fn.__doc__ or "")
        properties: dict[str, Any] = {}
        required: list[str] = []
        context_param = None
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {fn.__name__}: *args/**kwargs cannot be described to a model")
            if pname not in hints:
                raise TypeError(f"tool {fn.__name__}: parameter {pname!r} needs a type annotation")
            if hints[pname] is ToolContext:
                context_param = pname
                continue
            prop = _json_schema(hints[pname])
            if pname in arg_docs:
                prop["description"] = arg_docs[pname]
            properties[pname] = prop
            if param.default is param.empty:
                required.append(pname)
        if not description:
            raise TypeError(f"tool {fn.__name__}: give it a docstring; the model reads it as the tool's description")
        parameters = {"type": "object", "properties": properties, "required": required}
        return cls(fn=fn, name=name or fn.__name__, description=description, parameters=parameters,
                   timeout_s=timeout_s, deterministic=deterministic, context_param=context_param,
                   max_blocking_s=max_blocking_s)

    def validate_arguments(self, arguments: dict[str, Any]) -> ErrorRecord | None:
        """Check arguments against the schema; return a ``bad_arguments`` record naming the problem."""
        props, required = self.parameters["properties"], self.parameters["required"]
        missing = [p for p in required if p not in arguments]
        unknown = [a for a in arguments if a not in props]
        wrong = [a for a, v in arguments.items() if a in props and not _check_value(v, props[a])]
        if not (missing or unknown or wrong):
            return None
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unknown:
            parts.append(f"unknown {unknown} (expected {sorted(props)})")
        if wrong:
            parts.append("wrong type for " + ", ".join(f"{a} (expected {props[a].get('type', props[a])})" for a in wrong))
        return ErrorRecord("bad_arguments", f"tool {self.name}: " + "; ".join(parts), {"arguments": arguments})


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None, timeout_s: float = 30.0,
         deterministic: bool = False, max_blocking_s: float = 1.0) -> Any:
    """Decorator: ``@tool`` or ``@tool(timeout_s=5, deterministic=True)`` turns a typed function into a Tool."""
    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool.from_function(f, name=name, timeout_s=timeout_s, deterministic=deterministic,
                                  max_blocking_s=max_blocking_s)
    return wrap(fn) if fn is not None else wrap


_RESULT_HINT = "return JSON-serialisable values: str, int, float, bool, None, list, dict"
_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_text(text: str) -> str:
    """``text`` with lone surrogates (which no tokenizer can encode) replaced by U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", text)


def _render_result(tool_name: str, value: Any) -> str | ErrorRecord:
    """What the model reads for a tool's return value: a ``str`` as is, anything else as strict JSON.

    A value JSON cannot encode (a set, bytes, an arbitrary object, a dict key that is not a str/int/float/bool/
    None, a cycle, nesting too deep for the encoder) is a ``bad_tool_result`` record naming the tool and the
    type. NaN and ±inf are rejected the same way (strict JSON has no such numbers, and silently sending
    ``null`` would change the tool's answer): return ``None`` or a string such as ``"nan"`` instead.
    """
    if isinstance(value, str):
        return _valid_text(value)
    unencodable: list[str] = []

    def refuse(obj: Any) -> Any:
        unencodable.append(type(obj).__name__)
        raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")

    try:
        return json.dumps(value, allow_nan=False, default=refuse)
    except Exception as exc:  # any failure of the encoder is the value's fault (even a raising __iter__)
        bad_type = unencodable[-1] if unencodable else type(value).__name__
        if unencodable:
            what = f"a {bad_type}"
        elif isinstance(exc, ValueError) and "Out of range float" in str(exc):
            bad_type, what = "float", "a non-finite float (NaN or ±inf)"
        elif isinstance(exc, RecursionError):
            what = f"a {bad_type} nested too deeply to encode"
        else:
            what = f"a {bad_type} JSON cannot encode ({type(exc).__name__}: {exc})"
        return ErrorRecord("bad_tool_result", f"tool {tool_name} returned {what}; {_RESULT_HINT}",
                           {"tool": tool_name, "type": bad_type})


@types.coroutine
def _timed(awaitable: Any, held: list[float]) -> Any:
    """Await ``awaitable``, recording in ``held[0]`` the longest stretch it ran without yielding to the event
    loop (one ``send``/``throw`` of its coroutine). Values, exceptions and cancellation pass through unchanged;
    works on any backend, since it only relays what the coroutine yields.

    Automatic garbage collection waits until a stretch ends: a collection its allocations trigger costs time in
    proportion to the whole process's heap (0.4–0.8 s at 4,096 simulated agents), which is not the tool's doing
    and would otherwise be charged to it as blocking (and past ``max_blocking_s``, fail the call)."""
    inner = awaitable.__await__()
    to_send: Any = None
    to_throw: BaseException | None = None
    while True:
        collecting = gc.isenabled()
        gc.disable()
        began = time.perf_counter()
        try:
            yielded = inner.send(to_send) if to_throw is None else inner.throw(to_throw)
        except StopIteration as stop:
            return stop.value
        finally:
            held[0] = max(held[0], time.perf_counter() - began)
            if collecting:
                gc.enable()
        try:
            to_send, to_throw = (yield yielded), None
        except GeneratorExit:
            inner.close()
            raise
        except BaseException as exc:  # e.g. the cancellation of the deadline's scope: the tool gets it
            to_send, to_throw = None, exc


async def execute_tool_call(tools: Sequence[Tool], call: ToolCall, timeout_s: float | None = None,
                            context: ToolContext = ToolContext()) -> ToolResult:
    """Run one tool call to exactly one :class:`ToolResult`; every failure of the tool itself is its ``error``.

    ``context`` goes to a tool's :class:`ToolContext` parameter. A tool that raises
    :class:`~rollopt.errors.ToolFailed` gets its own typed record (e.g. ``sandbox_timeout``) in the result.
    The value becomes text as :func:`_render_result` says (else a ``bad_tool_result`` record).

    A sync tool runs in a worker thread. At its deadline the call returns a ``tool_timeout`` record; a sync
    tool's thread cannot be killed and finishes in the background (use the sandbox for untrusted code). An
    async tool runs on the event loop; one that runs without awaiting for longer than its deadline or its
    :attr:`Tool.max_blocking_s` (``time.sleep``, a blocking client) stalled every other call and stream and
    could not be interrupted: it gets a ``tool_blocked`` record naming how long it held the loop, whatever it
    returned. A call whose outcome arrives after its deadline is a ``tool_timeout`` even if the deadline's
    cancellation never reached it.
    """
    started = anyio.current_time()  # the event loop's clock: virtual under the simulated engine
    by_name = {t.name: t for t in tools}

    def result(content: str, error: ErrorRecord | None = None) -> ToolResult:
        return ToolResult(call.id, call.name, _valid_text(content), error, anyio.current_time() - started)

    chosen = by_name.get(call.name)
    if chosen is None:
        err = ErrorRecord("unknown_tool", f"no tool named {call.name!r}; available: {sorted(by_name)}")
        return result(f"Error: {err.message}", err)
    if (bad := chosen.validate_arguments(call.arguments)) is not None:
        return result(f"Error: {bad.message}", bad)
    deadline = chosen.timeout_s if timeout_s is None else timeout_s
    arguments = dict(call.arguments)
    if chosen.context_param is not None:
        arguments[chosen.context_param] = context
    held = [0.0]  # the longest stretch an async tool ran without awaiting
    failure: tuple[str, ErrorRecord] | None = None
    try:
        # a plain scope, not ``fail_after`` (two generator context managers per call): only its own deadline
        # can cancel it, so a caught cancellation is the timeout; a cancellation from outside propagates
        with anyio.CancelScope(deadline=anyio.current_time() + deadline) as scope:
            if inspect.iscoroutinefunction(chosen.fn):
                value = await _timed(chosen.fn(**arguments), held)
            else:
                value = await anyio.to_thread.run_sync(lambda: chosen.fn(**arguments), abandon_on_cancel=True)
    except ToolFailed as exc:
        failure = (exc.content, exc.record)
    except Exception as exc:  # the tool's own failure is data; cancellation (BaseException) propagates
        err = ErrorRecord.from_exception("tool_crash", exc, tool=call.name)
        failure = (f"Error: {err.message}", err)
    late = scope.cancelled_caught or anyio.current_time() >= scope.deadline
    if held[0] > min(deadline, chosen.max_blocking_s):
        err = ErrorRecord(
            "tool_blocked",
            f"tool {call.name} blocked the event loop for {held[0]:.2f}s without awaiting (its deadline is "
            f"{deadline:g}s, the limit {chosen.max_blocking_s:g}s), stalling every other call and stream; make it "
            "async-safe (await an async API or anyio.to_thread.run_sync) or define it with plain def so it runs "
            "in a worker thread",
            {"tool": call.name, "blocked_s": held[0], "deadline_s": deadline})
        return result(f"Error: {err.message}", err)
    if held[0] > SLOW_STRETCH_S:
        logger.warning("tool %s held the event loop for %.2fs without awaiting", call.name, held[0])
    if late:
        err = ErrorRecord("tool_timeout", f"tool {call.name} ran past its {deadline:g}s deadline")
        return result(f"Error: {err.message}", err)
    if failure is not None:
        return result(*failure)
    rendered = _render_result(call.name, value)
    if isinstance(rendered, ErrorRecord):
        return result(f"Error: {rendered.message}", rendered)
    return result(rendered)


# ------------------------------------------------------------------------------------------ environment


@dataclass(frozen=True)
class Task:
    """One problem: a stable id, the user prompt, the reference answer and free-form info."""

    id: str
    prompt: str
    answer: Any = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepOutcome:
    """What the environment says after one assistant turn."""

    observation: list[Message]
    done: bool
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EpisodeContext:
    """What :meth:`Environment.step` and :meth:`Environment.score` may read about the episode so far: its
    trajectory id, task and turn, and the trajectory itself (read it, never change it): every turn with its
    text, tool calls and tool results (the current turn's included), and the token records."""

    trajectory_id: str
    task: Task
    turn_index: int
    trajectory: Any  # rollopt.trajectory.Trajectory

    @property
    def tool_results(self) -> list[ToolResult]:
        """Every tool result of the episode so far, in order."""
        return [r for turn in self.trajectory.turns for r in turn.tool_results]


def accepts_context(method: Callable[..., Any]) -> bool:
    """Whether an environment hook takes the ``context`` keyword (older environments' hooks do not)."""
    try:
        return "context" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


class Environment(abc.ABC):
    """Base class of an environment. Subclasses set ``name``, implement :meth:`tasks`, :meth:`tools` and
    :meth:`score`, and may override :meth:`reset` and :meth:`step`.

    Contract (checked by :func:`rollopt.testing.check_environment`):

    * ``tasks(n, seed)`` is deterministic in ``seed`` and returns ``n`` tasks with unique ids;
    * ``reset(task)`` returns at least one message, ending with a user message;
    * ``step`` never raises for bad model output: malformed calls and failed tools become observations;
    * a turn with no tool call ends the episode and is scored; so does reaching ``max_turns``.

    ``step``, ``score``, ``turn_sampling`` and ``calls_for_turn`` may take a keyword ``context``
    (:class:`EpisodeContext`: the trajectory id, its turns and every earlier tool result), for rewards that
    depend on what happened before the last turn, or plans that differ per trajectory; the executor passes it
    to hooks whose signature has it.
    """

    name: ClassVar[str] = ""
    system_prompt: ClassVar[str | None] = None
    max_turns: int = 8
    show_tool_schemas: bool = True
    """Render the tools' JSON schemas into the prompt. A model already trained on the tools (a warm-started
    tiny one) may do without them: the prompt gets several hundred tokens shorter."""
    end_on_truncated_turn: ClassVar[bool] = True
    """A turn cut by ``max_new_tokens`` ends the episode as truncated (set False to let ``step`` decide)."""
    plans_calls: ClassVar[bool] = False
    """The one switch for benchmarking with a model that writes no tool calls (a random-init one): the calls
    come from :meth:`calls_for_turn` (planned), a turn cut by ``max_new_tokens`` does not end the episode (the
    plan sets its length), and the default :meth:`step` goes on while planned calls ran."""

    @abc.abstractmethod
    def tasks(self, n: int, seed: int) -> list[Task]:
        """``n`` seeded tasks."""

    @abc.abstractmethod
    def tools(self) -> list[Tool]:
        """The tools the model may call."""

    @abc.abstractmethod
    def score(self, task: Task, final_text: str) -> float:
        """The reward of an episode whose last assistant turn said ``final_text``."""

    def reset(self, task: Task) -> list[Message]:
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": task.prompt})
        return messages

    def prompt_tool_schemas(self) -> list[dict] | None:
        """The tool schemas the prompt shows (``None`` when :attr:`show_tool_schemas` is off)."""
        return [t.schema for t in self.tools()] if self.show_tool_schemas else None

    async def __aenter__(self) -> "Environment":
        """Acquire what the tools need for a whole rollout (e.g. a sandbox pool); ``async with env:`` around a
        rollout works for every environment. Default: nothing to acquire."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Release what :meth:`__aenter__` acquired. Default: nothing."""

    async def close_episode(self, trajectory_id: str) -> None:
        """Called once when an episode ends, however it ended, to release what its tools held for it (e.g. a
        sandbox session keyed by :attr:`ToolContext.trajectory_id`). Must not raise. Default: nothing to release."""

    def demonstration(self, task: Task) -> list[Message] | None:
        """A worked episode for ``task`` (the assistant and tool messages after :meth:`reset`), used for a
        supervised warm start; ``None`` (the default) when the environment has none."""
        return None

    def turn_sampling(self, task: Task, turn_index: int, sampling: SamplingParams) -> SamplingParams:
        """The sampling params of one turn (default: the episode's, unchanged)."""
        return sampling

    def calls_for_turn(self, task: Task, turn_index: int, parsed: ParsedTurn) -> list[ToolCall]:
        """The tool calls to run after a turn (default: the ones the model wrote). Synthetic workloads use
        this to attach planned calls; the executor schedules them like any other call."""
        return parsed.tool_calls

    def step(self, task: Task, turn_index: int, parsed: ParsedTurn, results: Sequence[ToolResult],
             context: EpisodeContext | None = None) -> StepOutcome:
        """Default flow: tool results (and parse errors) go back as ``tool`` messages; a turn without any
        call (the model's, or planned ones when :attr:`plans_calls`), or the last allowed turn, ends the episode
        with ``score`` (given ``context`` when it takes it)."""
        calls_made = results if self.plans_calls else (parsed.tool_calls or parsed.errors)
        if not calls_made or turn_index + 1 >= self.max_turns:
            extra = {"context": context} if context is not None and accepts_context(self.score) else {}
            return StepOutcome(observation=[], done=True, reward=self.score(task, parsed.content, **extra))
        observation: list[Message] = [
            {"role": "tool", "tool_call_id": r.call_id, "name": r.name, "content": r.content} for r in results
        ]
        observation += [{"role": "tool", "content": f"Error: {e.message}"} for e in parsed.errors]
        return StepOutcome(observation=observation, done=False)

