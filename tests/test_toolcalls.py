from rollopt import ToolCallStream, parse_tool_calls


def test_several_calls_in_one_turn():
    text = ('I will compute. <tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>\n{"name": "calc", "arguments": "{\\"expression\\": \\"3*4\\"}"}\n</tool_call> done')
    parsed = parse_tool_calls(text, id_prefix="t0.")
    assert [c.arguments for c in parsed.tool_calls] == [{"expression": "1+2"}, {"expression": "3*4"}]
    assert [c.id for c in parsed.tool_calls] == ["t0.0", "t0.1"]
    assert parsed.errors == []
    assert "tool_call" not in parsed.content and parsed.content.startswith("I will compute.")


def test_malformed_calls_become_records_and_others_survive():
    text = ('<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>[1, 2]</tool_call><tool_call>{"name": "ok", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "x", "arguments": 5}</tool_call><tool_call>{"name": "unclosed"')
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.tool_calls] == ["ok"]
    kinds = [e.kind for e in parsed.errors]
    assert kinds == ["tool_parse"] * 5
    messages = " | ".join(e.message for e in parsed.errors)
    assert "invalid JSON" in messages and 'missing "name"' in messages and "JSON object" in messages
    assert "without </tool_call>" in parsed.errors[-1].message
    ids = [c.id for c in parsed.tool_calls] + [e.detail["call_id"] for e in parsed.errors]
    assert len(set(ids)) == 6


def test_stream_reports_a_call_as_soon_as_it_closes():
    stream = ToolCallStream()
    pieces = ['<tool_', 'call>{"name": "a", "argu', 'ments": {}}</tool', '_call> more text <tool_call>',
              '{"name": "b"}</tool_call>']
    seen = [[getattr(x, "name", None) for x in stream.feed(p)] for p in pieces]
    assert seen == [[], [], [], ["a"], ["b"]]
    final = stream.close()
    assert [c.name for c in final.tool_calls] == ["a", "b"] and final.content == "more text"
