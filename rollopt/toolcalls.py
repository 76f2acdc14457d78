"""Parse Hermes/Qwen-style tool calls out of model text, in one go or incrementally from a decode stream.

Format: ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``, any number per turn, whitespace
allowed inside the tags. ``"parameters"`` (the key Llama 3.x and some Qwen templates use) is accepted in place
of ``"arguments"`` (both at once is an error), and arguments given as a JSON-encoded string are decoded, as
OpenAI sends them.

Contract: parsing never raises, whatever the text. A malformed call becomes an :class:`ErrorRecord` of kind
``"tool_parse"`` that names what is wrong, and the other calls of the turn are still returned. The cost is
bounded: a call payload over :data:`MAX_CALL_CHARS` characters or nested deeper than :data:`MAX_JSON_DEPTH`
is an error before ``json.loads`` sees it (so no ``RecursionError``, and the verdict does not depend on how
deep the caller's stack is), and the stream scans each character a bounded number of times.

:class:`ToolCallStream` is the incremental form: feed it decoded text as it streams and it hands back each
call the moment its closing tag appears, so a scheduler can start the tool while the turn is still decoding.
However the text is split into deltas, ``close()`` returns the same :class:`ParsedTurn` as
:func:`parse_tool_calls` on the whole text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from rollopt.errors import ErrorRecord
from rollopt.trajectory import ToolCall

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
MAX_CALL_CHARS = 262_144
"""The longest call payload (the text between the tags) that is parsed, about 65k tokens; longer is an error."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of JSON arrays and objects a call may use; deeper is an error."""
_DETAIL_CHARS = 4_096  # an error record keeps at most this much of the offending text

_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


@dataclass
class ParsedTurn:
    """What one assistant turn said: its text without the tool-call blocks, its calls, its parse errors."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[ErrorRecord] = field(default_factory=list)


def _excerpt(text: str) -> str:
    return text if len(text) <= _DETAIL_CHARS else f"{text[:_DETAIL_CHARS]}…[{len(text) - _DETAIL_CHARS} more chars]"


def _nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in ``text``: exact for valid JSON, never below it otherwise. Linear,
    at C speed: escaped characters and then strings are cut out, and the brackets left are counted."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0  # cannot be too deep; skip the scan
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside_strings = "".join(unescaped.split('"')[0::2])
    brackets = _NOT_BRACKET.sub("", outside_strings)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _loads(text: str) -> tuple[Any, str | None]:
    """``(value, None)`` or ``(None, why it is not acceptable JSON)``; never raises."""
    if len(text) > MAX_CALL_CHARS:
        return None, f"{len(text)} characters, over the limit of {MAX_CALL_CHARS}"
    if _nesting_depth(text) > MAX_JSON_DEPTH:
        return None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON ({exc.msg} at char {exc.pos})"
    except (ValueError, RecursionError) as exc:  # e.g. an integer of more than 4300 digits
        return None, f"invalid JSON ({exc})"


def _parse_block(body: str, call_id: str) -> ToolCall | ErrorRecord:
    def bad(why: str) -> ErrorRecord:
        return ErrorRecord("tool_parse", f"malformed tool call {call_id}: {why}",
                           {"text": _excerpt(body), "call_id": call_id})

    obj, why = _loads(body)
    if why is not None:
        return bad(why)
    if not isinstance(obj, dict):
        return bad(f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return bad('missing "name" (a non-empty string)')
    if "arguments" in obj and "parameters" in obj:
        return bad('both "arguments" and "parameters"; give the arguments once, under "arguments"')
    key = "parameters" if "parameters" in obj else "arguments"
    args = obj.get(key, {})
    if isinstance(args, str):  # OpenAI sends the arguments as a JSON-encoded string
        args, why = _loads(args) if args.strip() else ({}, None)
        if why is not None:
            return bad(f'"{key}" is a string that is not acceptable JSON: {why}')
    if not isinstance(args, dict):
        return bad(f'"{key}" must be a JSON object, got {type(args).__name__}')
    return ToolCall(id=call_id, name=name, arguments=args)


class ToolCallStream:
    """Incremental tool-call parser over a stream of text deltas.

    ``feed(delta)`` returns the calls (and parse errors) completed by that delta; ``close()`` reports an
    unclosed block at the end of the turn and returns the final :class:`ParsedTurn` of everything fed (the same
    as :func:`parse_tool_calls` on the concatenated deltas). Call ids are ``f"{id_prefix}{n}"`` with ``n``
    counting from 0 over the turn.
    """

    def __init__(self, id_prefix: str = "call_") -> None:
        self._id_prefix = id_prefix
        self._text = ""
        self._scan = 0  # everything before this offset has been consumed
        self._open = -1  # offset of the open tag of the block being read, or -1
        self._search = 0  # the next tag search starts here: no tag begins in [_scan or _open, _search)
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
            if self._open < 0:
                start = self._text.find(OPEN_TAG, self._search)
                if start < 0:  # a tag may still begin in the last few characters
                    self._search = max(self._scan, len(self._text) - len(OPEN_TAG) + 1)
                    break
                self._open = start
                self._search = start + len(OPEN_TAG)
            end = self._text.find(CLOSE_TAG, self._search)
            if end < 0:
                self._search = max(self._open + len(OPEN_TAG), len(self._text) - len(CLOSE_TAG) + 1)
                break
            self._content.append(self._text[self._scan:self._open])
            item = _parse_block(self._text[self._open + len(OPEN_TAG):end].strip(), self._next_id())
            (self._result.tool_calls if isinstance(item, ToolCall) else self._result.errors).append(item)
            completed.append(item)
            self._scan = self._search = end + len(CLOSE_TAG)
            self._open = -1
        return completed

    def close(self) -> ParsedTurn:
        if not self._closed:
            self._closed = True
            if self._open >= 0:
                self._content.append(self._text[self._scan:self._open])
                self._result.errors.append(
                    ErrorRecord(
                        "tool_parse",
                        f"malformed tool call {self._next_id()}: {OPEN_TAG} without {CLOSE_TAG}",
                        {"text": _excerpt(self._text[self._open:]), "call_id": self._next_id()},
                    )
                )
            else:
                self._content.append(self._text[self._scan:])
            self._result.content = "".join(self._content).strip()
        return self._result


def parse_tool_calls(text: str, id_prefix: str = "call_") -> ParsedTurn:
    """Parse a whole turn's text at once."""
    stream = ToolCallStream(id_prefix)
    stream.feed(text)
    return stream.close()
