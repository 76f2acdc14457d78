"""Hostile input never takes down a batch: each bad tool value, pathological tool-call text or event-loop-blocking
tool becomes a typed record on its own call or turn, and the other calls and trajectories go on.

Property tests run with ``derandomize=True, database=None``: every run (locally and in CI) draws the same
examples and no example database is kept, and the cases that once broke the batch are pinned with ``@example``.
"""

from __future__ import annotations

import datetime
import decimal
import fractions
import json
import logging
import math
import pathlib
import re
import time
import uuid

import anyio
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from rollopt import (
    ChatRenderer, Environment, ParsedTurn, SamplingParams, ScriptedEngine, Task, Tool, ToolCall, ToolCallStream,
    episode_specs, execute_tool_call, parse_tool_calls, run_rollout, tool,
)
from rollopt.errors import ErrorRecord

HOSTILE = settings(derandomize=True, database=None, deadline=None, print_blob=False,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VALUE_EXAMPLES, PARSE_EXAMPLES, CHUNK_EXAMPLES = 300, 400, 300
HINT = "return JSON-serialisable values: str, int, float, bool, None, list, dict"


def returning(value, *, is_async: bool = False) -> Tool:
    """A tool named ``give`` that returns ``value``."""
    if is_async:
        async def give() -> object:
            """Return the value."""
            return value
    else:
        def give() -> object:
            """Return the value."""
            return value
    return Tool.from_function(give)


def run_one(tools, call, **kw):
    return anyio.run(lambda: execute_tool_call(tools, call, **kw))


def strict_loads(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not strict JSON")
    return json.loads(text, parse_constant=refuse)


# ------------------------------------------------------------------------- 1. values JSON cannot encode


class Opaque:
    pass


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("value, type_name", [
    ({"a", "b"}, "set"), (b"\x00raw", "bytes"), (Opaque(), "Opaque"), ({"ok": [1, {"deep": {1, 2}}]}, "set"),
    (float("nan"), "float"), ({"x": float("inf")}, "float"), ([-math.inf], "float"),
])
def test_a_value_json_cannot_encode_is_a_typed_error_naming_the_tool(value, type_name, is_async):
    res = run_one([returning(value, is_async=is_async)], ToolCall("c", "give", {}))
    assert not res.ok and res.error.kind == "bad_tool_result"
    assert "tool give" in res.error.message and HINT in res.error.message
    assert res.error.detail["type"] == type_name and res.content.startswith("Error:")


def test_a_returned_string_with_lone_surrogates_reaches_the_model_as_valid_text():
    res = run_one([returning("a\ud800b")], ToolCall("c", "give", {}))
    assert res.ok and res.content == "a\ufffdb"
    res.content.encode("utf-8")


# ------------------------------------------------------------------------- 2. pathological tool-call text


def call_text(payload: str) -> str:
    return f"before <tool_call>{payload}</tool_call> between " \
           '<tool_call>{"name": "ok", "arguments": {"n": 1}}</tool_call> after'


@pytest.mark.parametrize("payload, words", [
    ('{"name": "f", "arguments": {"x": ' + "[" * 3000 + "]" * 3000 + "}}", "nested deeper"),
    ("[" * 100_000, "nested deeper"),
    ('{"name": "f", "arguments": "' + '{\\"a\\": ' * 3000 + "1" + "}" * 3000 + '"}', "nested deeper"),
    ('{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}", "digits"),
    ('{"name": "f", "arguments": {"x": "' + "a" * 300_000 + '"}}', "over the limit"),
])
def test_pathological_calls_are_parse_errors_and_the_turn_goes_on(payload, words):
    text = call_text(payload)
    for parsed in (parse_tool_calls(text), chunked(text, range(0, len(text), 997))):
        assert [c.name for c in parsed.tool_calls] == ["ok"] and parsed.tool_calls[0].id == "call_1"
        assert len(parsed.errors) == 1 and parsed.errors[0].kind == "tool_parse"
        assert words in parsed.errors[0].message and parsed.errors[0].detail["call_id"] == "call_0"
        assert len(parsed.errors[0].detail["text"]) < 5000  # the record keeps an excerpt, not megabytes
        assert parsed.content == "before  between  after"


def test_nesting_inside_a_string_is_not_nesting():
    parsed = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"s": "' + "[{" * 500 + '\\"]"}}</tool_call>')
    assert parsed.errors == [] and parsed.tool_calls[0].arguments == {"s": "[{" * 500 + '"]'}


# ------------------------------------------------------------------------- 3. "parameters" for "arguments"


def test_parameters_is_an_alias_of_arguments():
    parsed = parse_tool_calls('<tool_call>{"name": "book", "parameters": {"flight_id": "LH40"}}</tool_call>'
                              '<tool_call>{"name": "book", "parameters": "{\\"flight_id\\": \\"BA1\\"}"}</tool_call>'
                              '<tool_call>{"name": "book", "arguments": "{\\"flight_id\\": \\"AF9\\"}"}</tool_call>')
    assert parsed.errors == []
    assert [c.arguments for c in parsed.tool_calls] == [{"flight_id": "LH40"}, {"flight_id": "BA1"},
                                                       {"flight_id": "AF9"}]


def test_arguments_and_parameters_together_are_a_parse_error():
    parsed = parse_tool_calls('<tool_call>{"name": "book", "arguments": {}, "parameters": {"flight_id": "x"}}'
                              "</tool_call>")
    assert parsed.tool_calls == [] and len(parsed.errors) == 1
    assert '"arguments" and "parameters"' in parsed.errors[0].message


# ------------------------------------------------------------------------- 4. a blocked event loop


async def _nap_blocking(seconds: float) -> str:
    """Sleep without awaiting (a bug: it blocks the event loop)."""
    time.sleep(seconds)
    return "rested"


async def _nap(seconds: float) -> str:
    """Sleep, awaiting."""
    await anyio.sleep(seconds)
    return "rested"


@pytest.mark.asyncio  # explicit, so that it also runs where asyncio_mode is not auto
async def test_a_tool_blocking_the_loop_past_its_deadline_is_named_and_the_others_go_on():
    blocker = Tool.from_function(_nap_blocking, name="blocker", timeout_s=0.1)
    polite = Tool.from_function(_nap, name="polite", timeout_s=5.0)
    results = {}

    async def one(call):
        results[call.name] = await execute_tool_call([blocker, polite], call)

    async with anyio.create_task_group() as tg:
        tg.start_soon(one, ToolCall("a", "blocker", {"seconds": 0.5}))
        tg.start_soon(one, ToolCall("b", "polite", {"seconds": 0.01}))
    bad = results["blocker"]
    assert not bad.ok and bad.error.kind == "tool_blocked"
    assert re.search(r"tool blocker blocked the event loop for 0\.[5-9]\d*s", bad.error.message)
    assert "plain def" in bad.error.message and 0.45 < bad.error.detail["blocked_s"] < 5
    assert results["polite"].ok and results["polite"].content == "rested"


@pytest.mark.asyncio  # explicit, so that it also runs where asyncio_mode is not auto
async def test_blocking_within_the_deadline_fails_over_max_blocking_s_and_is_logged_under_it(caplog):
    strict = Tool.from_function(_nap_blocking, name="strict", timeout_s=30, max_blocking_s=0.05)
    lenient = Tool.from_function(_nap_blocking, name="lenient", timeout_s=30, max_blocking_s=10)
    res = await execute_tool_call([strict], ToolCall("c", "strict", {"seconds": 0.15}))
    assert res.error.kind == "tool_blocked" and "tool strict" in res.error.message
    with caplog.at_level(logging.WARNING, logger="rollopt.step"):
        res = await execute_tool_call([lenient], ToolCall("c", "lenient", {"seconds": 0.15}))
    assert res.ok and re.search(r"tool lenient held the event loop for 0\.[1-9]\d*s", caplog.text)


@pytest.mark.asyncio  # explicit, so that it also runs where asyncio_mode is not auto
async def test_a_garbage_collection_the_tool_triggers_is_not_charged_to_it_as_blocking():
    """A collection's cost grows with the whole heap (0.4–0.8 s at 4,096 simulated agents), not with what the
    tool did: here every collection is made to take 0.3 s, and a tool that allocates enough to trigger one
    (but never blocks) must pass a 0.2 s ``max_blocking_s``. Collections wait until the stretch ends."""
    import gc

    slow_collections = []

    def slow_collection(phase: str, info: dict) -> None:
        if phase == "start" and slow_collections:
            slow_collections.pop()
            time.sleep(0.3)

    async def allocate(n: int) -> str:
        """Allocate cyclic garbage enough to trigger collections, without awaiting."""
        for _ in range(n):
            cycle: list = []
            cycle.append(cycle)
        return "done"

    tool = Tool.from_function(allocate, name="allocate", timeout_s=30, max_blocking_s=0.2)
    gc.callbacks.append(slow_collection)
    try:
        slow_collections.append(True)
        result = await execute_tool_call([tool], ToolCall("g", "allocate", {"n": 20_000}))
    finally:
        gc.callbacks.remove(slow_collection)
    assert result.ok and result.content == "done"
    assert gc.isenabled()


# ------------------------------------------------------------------------- the batch goes on (end to end)


@tool
def lookup(flight_id: str) -> dict:
    """Find a flight."""
    return {"flight": flight_id, "seats": 3}


@tool
def tags() -> list:
    """Tags of the route (returns a set: a bug)."""
    return {"a", "b"}


@tool(timeout_s=0.1)
async def nap() -> str:
    """Blocks the loop (a bug)."""
    time.sleep(0.3)
    return "rested"


TURNS = {
    "alias": '<tool_call>{"name": "lookup", "parameters": {"flight_id": "LH40"}}</tool_call>',
    "set": '<tool_call>{"name": "tags", "arguments": {}}</tool_call>',
    "block": '<tool_call>{"name": "nap", "arguments": {}}</tool_call>',
    "deep": '<tool_call>{"name": "lookup", "arguments": {"flight_id": ' + "[" * 1500 + "]" * 1500 + "}}</tool_call>",
    "fine": '<tool_call>{"name": "lookup", "arguments": {"flight_id": "BA1"}}</tool_call>',
}


class HostileEnv(Environment):
    name = "hostile"
    max_turns = 2

    def tasks(self, n, seed):
        return [Task(id=k, prompt="fly") for k in TURNS]

    def tools(self):
        return [lookup, tags, nap]

    def score(self, task, final_text):
        return 1.0


@pytest.mark.asyncio  # explicit, so that it also runs where asyncio_mode is not auto
@pytest.mark.parametrize("scheduler", ["sync", "overlap"])
async def test_each_hostile_input_fails_only_its_own_call_and_the_batch_completes(tokenizer, scheduler):
    env, renderer = HostileEnv(), ChatRenderer(tokenizer)

    def script(request):
        task_id, turn = request.rid.split(".s")[0], int(request.rid.rsplit(".t", 1)[1].split(".")[0])
        return renderer.encode(TURNS[task_id] if turn == 0 else "done") + [renderer.end_of_turn_id]

    engine = ScriptedEngine(script, eos_token_id=renderer.end_of_turn_id)
    specs = episode_specs(env.tasks(5, 0), 1, SamplingParams(max_new_tokens=4000, temperature=0), seed=0)
    trajs = {t.task_id: t for t in await run_rollout(env, engine, renderer, specs, scheduler)}
    assert sorted(trajs) == sorted(TURNS) and all(t.error is None and t.reward == 1.0 for t in trajs.values())
    kind = {k: (t.tool_results[0].error.kind if t.tool_results and t.tool_results[0].error else None)
            for k, t in trajs.items()}
    assert kind == {"alias": None, "set": "bad_tool_result", "block": "tool_blocked", "deep": None, "fine": None}
    assert json.loads(trajs["alias"].tool_results[0].content) == {"flight": "LH40", "seats": 3}
    assert [e.kind for e in trajs["deep"].turns[0].parse_errors] == ["tool_parse"]


# ------------------------------------------------------------------------- 5. properties


def jsonable(value) -> bool:
    """What strict JSON can encode, written independently of the encoder."""
    if value is None or isinstance(value, (bool, str, int)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(jsonable(v) for v in value)
    if isinstance(value, dict):
        keys_ok = all(k is None or isinstance(k, (str, int)) or (isinstance(k, float) and math.isfinite(k))
                      for k in value)
        return keys_ok and all(jsonable(v) for v in value.values())
    return False


def as_json(value):
    """``value`` as ``json.loads`` gives it back (tuples become lists, dict keys strings)."""
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {k if isinstance(k, str) else json.dumps(k): as_json(v) for k, v in value.items()}
    return value


hashable = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(max_size=5) \
    | st.tuples(st.integers(), st.text(max_size=3))
scalar = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=8)
          | st.complex_numbers() | st.decimals() | st.fractions() | st.builds(Opaque) | st.builds(object)
          | st.builds(pathlib.PurePosixPath, st.text(max_size=5))
          | st.sampled_from([datetime.date, datetime.timedelta, uuid.UUID, range, bytearray, decimal.Decimal,
                             fractions.Fraction, complex, frozenset, type]).flatmap(st.from_type))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10)
values = json_values | st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
                                    | st.dictionaries(hashable, inner, max_size=4) | st.sets(hashable, max_size=3)
                                    | st.frozensets(hashable, max_size=3), max_leaves=10)


@settings(HOSTILE, max_examples=VALUE_EXAMPLES)
@given(value=values, is_async=st.booleans())
@example(value={1, 2}, is_async=False).via("set")
@example(value=b"x", is_async=True).via("bytes")
@example(value=[float("nan")], is_async=False).via("nan")
@example(value={"k": -math.inf}, is_async=True).via("inf")
@example(value={(1, 2): 3}, is_async=False).via("tuple key")
def test_any_return_value_gives_one_result_ok_iff_json_encodable(value, is_async):
    res = run_one([returning(value, is_async=is_async)], ToolCall("c", "give", {}))
    assert res.call_id == "c" and res.name == "give"
    assert res.ok == jsonable(value), (value, res)
    event("ok" if res.ok else "bad_tool_result")
    res.content.encode("utf-8")  # valid text for any tokenizer
    if not res.ok:
        assert res.error.kind == "bad_tool_result" and "tool give" in res.error.message
    elif not isinstance(value, str):
        assert strict_loads(res.content) == as_json(value)


fragment = st.one_of(
    st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "call>", "</tool", "{", "}", "[", "]", '"', "\\",
                     '\\"', '"name"', '"arguments"', '"parameters"', ":", ",", " ", "\n", "NaN", "1e999", "null",
                     '"f"', "\ufffd", '{"name": "f", "arguments": {"a": 1}}', '{"name": "f", "parameters": {}}',
                     '{"name": "f", "arguments": "{\\"a\\": [1]}"}', '{"name": "f"']),
    st.text(max_size=12),
    st.binary(max_size=12).map(lambda b: b.decode("utf-8", "replace")),  # invalid UTF-8 decoded as a model's is
    st.integers(60, 3000).map(lambda n: "[" * n),
    st.integers(60, 3000).map(lambda n: "{\"a\": " * n),
    st.integers(4000, 6000).map(lambda n: "7" * n),
)


@st.composite
def well_formed_call(draw) -> str:
    """A call as a model might write it: "arguments", "parameters" or both, maybe as a JSON-encoded string."""
    args = draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
    keys = draw(st.sampled_from([["arguments"], ["parameters"], ["arguments", "parameters"], []]))
    as_string = draw(st.booleans())
    call = {"name": draw(st.sampled_from(["f", "book", "f", ""]))}
    call.update({k: json.dumps(args) if as_string else args for k in keys})
    return json.dumps(call)


payload = well_formed_call() | st.lists(fragment, max_size=6).map("".join)
closing = st.sampled_from(["</tool_call>", "</tool_call>", "</tool_call>", " </tool_call>\n", "", "</tool_"])
block = st.tuples(payload, closing).map(lambda pc: "<tool_call>" + pc[0] + pc[1])
prose = st.just("") | fragment
turn_text = st.tuples(st.lists(st.tuples(prose, block).map("".join), max_size=6).map("".join), prose).map("".join)
DEEP = "<tool_call>" + "[" * 2000 + "</tool_call><tool_call>" + '{"name": "f", "parameters": {"a": 1}}</tool_call>'


@settings(HOSTILE, max_examples=PARSE_EXAMPLES)
@given(text=turn_text)
@example(text=DEEP).via("deep nesting")
@example(text='<tool_call>{"name": "f", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>").via("huge int")
@example(text='<tool_call>{"name": "f", "arguments": {"a": 1}}').via("missing close tag")
def test_the_parser_never_raises_and_accounts_for_every_call(text):
    parsed = parse_tool_calls(text, id_prefix="t.")
    assert isinstance(parsed, ParsedTurn)
    assert all(isinstance(c, ToolCall) and isinstance(c.arguments, dict) and c.name for c in parsed.tool_calls)
    assert all(isinstance(e, ErrorRecord) and e.kind == "tool_parse" for e in parsed.errors)
    ids = [c.id for c in parsed.tool_calls] + [e.detail["call_id"] for e in parsed.errors]
    assert sorted(ids, key=lambda i: int(i[2:])) == [f"t.{n}" for n in range(len(ids))]
    assert (len(ids) > 0) == ("<tool_call>" in text) and len(ids) <= text.count("<tool_call>")
    event(f"calls: {min(len(parsed.tool_calls), 2)}, parse errors: {min(len(parsed.errors), 2)} (2 = 2+)")


def chunked(text: str, cuts) -> ParsedTurn:
    stream, bounds, seen = ToolCallStream(), sorted({0, len(text), *cuts}), []
    for a, b in zip(bounds, bounds[1:]):
        seen += stream.feed(text[a:b])
    final = stream.close()
    # what feed() handed out, in order, is every call and error but an unclosed block (reported by close())
    everything = sorted(final.tool_calls + final.errors, key=lambda x: int(
        (x.id if isinstance(x, ToolCall) else x.detail["call_id"]).rsplit("_", 1)[1]))
    unclosed = [e for e in final.errors if "without </tool_call>" in e.message]
    assert seen == everything[:len(everything) - len(unclosed)]
    return final


@settings(HOSTILE, max_examples=CHUNK_EXAMPLES)
@given(data=st.data(), text=turn_text)
@example(data=None, text=DEEP).via("deep nesting, cut everywhere")
def test_the_stream_gives_the_same_turn_however_the_text_is_cut(data, text):
    if data is None:
        cuts = range(len(text))
    else:
        cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12)) if text else []
    assert chunked(text, cuts) == parse_tool_calls(text)
