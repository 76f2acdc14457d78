from typing import Literal, Optional

import anyio
import pytest

from rollopt import Tool, ToolCall, execute_tool_call, tool


@tool(timeout_s=2.0, deterministic=True)
def convert(amount: float, unit: Literal["km", "mi"], digits: int = 2, tags: Optional[list[str]] = None) -> dict:
    """Convert a distance.

    Args:
        amount: the distance to convert.
        unit: the unit of ``amount``.
        digits: rounding digits,
            counted after the point.
    """
    factor = 0.621371 if unit == "km" else 1.609344
    return {"value": round(amount * factor, digits)}


@tool
async def slow(seconds: float) -> str:
    """Sleep, then answer."""
    await anyio.sleep(seconds)
    return "awake"


@tool
def explode(x: int) -> int:
    """Always fails."""
    raise RuntimeError(f"boom {x}")


@tool
async def gives_up(url: str) -> str:
    """Fails with its own timeout, long before its deadline."""
    raise TimeoutError(f"upstream {url} did not answer")


TOOLS = [convert, slow, explode, gives_up]


def test_schema_from_signature_and_docstring():
    fn = convert.schema["function"]
    assert fn["name"] == "convert" and fn["description"] == "Convert a distance."
    props = fn["parameters"]["properties"]
    assert props["amount"] == {"type": "number", "description": "the distance to convert."}
    assert props["unit"]["enum"] == ["km", "mi"]
    assert props["digits"]["description"] == "rounding digits, counted after the point."
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert fn["parameters"]["required"] == ["amount", "unit"]
    assert convert.deterministic and convert.timeout_s == 2.0


def test_tool_definitions_that_cannot_be_described_are_refused():
    def untyped(x):
        """Doc."""

    def undocumented(x: int):
        pass

    with pytest.raises(TypeError, match="annotation"):
        Tool.from_function(untyped)
    with pytest.raises(TypeError, match="docstring"):
        Tool.from_function(undocumented)


async def test_sync_and_async_tools_run():
    res = await execute_tool_call(TOOLS, ToolCall("c", "convert", {"amount": 10, "unit": "km"}))
    assert res.ok and res.content == '{"value": 6.21}'
    res = await execute_tool_call(TOOLS, ToolCall("d", "slow", {"seconds": 0}))
    assert res.ok and res.content == "awake" and res.call_id == "d"


@pytest.mark.parametrize("call, kind, words", [
    (ToolCall("c", "nope", {}), "unknown_tool", "available"),
    (ToolCall("c", "convert", {"unit": "km"}), "bad_arguments", "missing ['amount']"),
    (ToolCall("c", "convert", {"amount": "ten", "unit": "km"}), "bad_arguments", "wrong type for amount"),
    (ToolCall("c", "convert", {"amount": 1, "unit": "parsec"}), "bad_arguments", "wrong type for unit"),
    (ToolCall("c", "convert", {"amount": 1, "unit": "km", "extra": 1}), "bad_arguments", "unknown ['extra']"),
    (ToolCall("c", "explode", {"x": 3}), "tool_crash", "RuntimeError: boom 3"),
    # a timeout the tool raises itself is its failure, not a missed deadline
    (ToolCall("c", "gives_up", {"url": "x.test"}), "tool_crash", "TimeoutError: upstream x.test did not answer"),
])
async def test_tool_failures_are_typed_records(call, kind, words):
    res = await execute_tool_call(TOOLS, call)
    assert not res.ok and res.error.kind == kind and words in res.error.message
    assert res.content.startswith("Error:")


async def test_a_hung_tool_returns_a_timeout_record():
    res = await execute_tool_call(TOOLS, ToolCall("c", "slow", {"seconds": 30}), timeout_s=0.05)
    assert res.error.kind == "tool_timeout" and "deadline" in res.error.message


async def test_cancellation_is_not_swallowed():
    with anyio.move_on_after(0.05) as scope:
        await execute_tool_call(TOOLS, ToolCall("c", "slow", {"seconds": 30}), timeout_s=60)
        pytest.fail("execute_tool_call returned although its caller was cancelled")
    assert scope.cancelled_caught
