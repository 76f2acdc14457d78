"""Parse Hermes/Qwen-style tool calls out of model text, in one go or incrementally from a decode stream.

Format: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``, any number per turn, whitespace
allowed inside the tags. A malformed call never raises: it becomes an :class:`ErrorRecord` of kind
``"tool_parse"`` that names what is wrong, and the other calls of the turn are still returned.

:class:`ToolCallStream` is the incremental form: feed it decoded text as it streams and it hands back each
call the moment its closing tag appears, so a scheduler can start the tool while the turn is still decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rollopt.errors import ErrorRecord
from rollopt.trajectory import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ParsedTurn:
    """What one assistant turn said: its text without the tool-call blocks, its calls, its parse errors."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ErrorRecord] = field(default_factory=list)


def _parse_block(body: str, call_id: str) -> ToolCall | ErrorRecord:
    def bad(why: str) -> ErrorRecord:
        return ErrorRecord("tool_parse", f"malformed tool call {call_id}: {why}", {"text": body, "call_id": call_id})

    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return bad(f"invalid JSON ({exc.msg} at char {exc.pos})")
    if not isinstance(obj, dict):
        return bad(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return bad('missing "name" (a non-empty string)')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return bad(f'"arguments" is a string that is not valid JSON ({exc.msg})')
    if not isinstance(args, dict):
        return bad(f'"arguments" must be a JSON object, got {type(args).__name__}')
    return ToolCall(id=call_id, name=name, arguments=args)


class ToolCallStream:
    """Incremental tool-call parser over a stream of text deltas.

    ``feed(delta)`` returns the calls (and parse errors) completed by that delta; ``close()`` reports an
    unclosed block at the end of the turn and returns the final :class:`ParsedTurn` of everything fed.
    Call ids are ``f"{id_prefix}{n}"`` with ``n`` counting from 0 over the turn.
    """

    def __init__(self, id_prefix: str = "call_") -> None:
        self._id_prefix = id_prefix
        self._text = ""
        self._scan = 0  # everything before this offset has been consumed
        self._content: list[str] = []
        self._result = ParsedTurn(content="")
        self._closed = False

    def _next_id(self) -> str:
        return f"{self._id_prefix}{len(self._result.tool_calls) + len(self._result.errors)}"

    def feed(self, delta: str) -> list[ToolCall | ErrorRecord]:
        if self._closed:
            raise RuntimeError("feed() after close()")
        self._text += delta
        completed: list[ToolCall | ErrorRecord] = []
        while True:
            start = self._text.find(OPEN_TAG, self._scan)
            if start < 0:
                break
            end = self._text.find(CLOSE_TAG, start + len(OPEN_TAG))
            if end < 0:
                break
            self._content.append(self._text[self._scan:start])
            item = _parse_block(self._text[start + len(OPEN_TAG):end].strip(), self._next_id())
            (self._result.tool_calls if isinstance(item, ToolCall) else self._result.errors).append(item)
            completed.append(item)
            self._scan = end + len(CLOSE_TAG)
        return completed

    def close(self) -> ParsedTurn:
        if not self._closed:
            self._closed = True
            rest = self._text[self._scan:]
            start = rest.find(OPEN_TAG)
            if start >= 0:
                self._content.append(rest[:start])
                self._result.errors.append(
                    ErrorRecord(
                        "tool_parse",
                        f"malformed tool call {self._next_id()}: {OPEN_TAG} without {CLOSE_TAG}",
                        {"text": rest[start:], "call_id": self._next_id()},
                    )
                )
            else:
                self._content.append(rest)
            self._result.content = "".join(self._content).strip()
        return self._result


def parse_tool_calls(text: str, id_prefix: str = "call_") -> ParsedTurn:
    """Parse a whole turn's text at once."""
    stream = ToolCallStream(id_prefix)
    stream.feed(text)
    return stream.close()
