"""Per-trajectory phase timelines and their Chrome trace, on a hand-built rollout graph with known times."""

from __future__ import annotations

import pytest
from trace_checks import check_trace

from rollopt.graph import RolloutGraph
from rollopt.timeline import Span, chrome_trace, engine_busy_s, lifetime, timeline_totals, trajectory_phases


def _step(g: RolloutGraph, kind: str, traj: str, start: float, end: float, **attrs) -> str:
    node = g.add(kind, traj, start=start, **{k: v for k, v in attrs.items() if k in ("turn", "segment", "call")})
    g.finish(node, end, **{k: v for k, v in attrs.items() if k not in ("turn", "segment", "call")})
    return node


@pytest.fixture()
def graph() -> RolloutGraph:
    """Trajectory ``a``: waits at the gate, decodes a turn whose first tool starts early (overlapping decode)
    next to a parallel one, decodes a second turn and is preempted in it. Trajectory ``b``: carried over,
    resumes its turn (segment 1) and finishes."""
    g = RolloutGraph()
    _step(g, "prompt", "a", 0.0, 0.0)
    _step(g, "generate", "a", 1.0, 3.0, turn=0, segment=0, first_token=1.5, status="stop")
    _step(g, "tool", "a", 2.5, 4.0, call="c0")
    _step(g, "tool", "a", 3.0, 5.0, call="c1")
    _step(g, "observe", "a", 5.5, 5.5)
    _step(g, "generate", "a", 6.0, 7.0, turn=1, segment=0, first_token=6.25, status="abort")
    g.mark("a", "preempted", 7.0)
    _step(g, "prompt", "b", 0.0, 0.0, resumed=True)
    _step(g, "generate", "b", 0.5, 2.0, turn=2, segment=1, first_token=1.0, status="stop")
    _step(g, "reward", "b", 2.0, 2.0)
    g.close(8.0)
    return g


def test_phases_partition_each_lifetime_by_priority(graph):
    assert lifetime(graph, "a") == (0.0, 8.0) and lifetime(graph, "b") == (0.0, 2.0)
    assert trajectory_phases(graph, "a") == [
        Span("queue", 0.0, 1.0), Span("prefill", 1.0, 1.5), Span("decode", 1.5, 3.0),  # c0 hidden under decode
        Span("tool", 3.0, 5.0), Span("queue", 5.0, 6.0), Span("prefill", 6.0, 6.25), Span("decode", 6.25, 7.0),
        Span("preempted", 7.0, 8.0)]
    assert trajectory_phases(graph, "b") == [Span("queue", 0.0, 0.5), Span("resumed", 0.5, 1.0),
                                             Span("decode", 1.0, 2.0)]


def test_totals_sum_phases_and_engine_busy_is_the_union_of_requests(graph):
    totals = timeline_totals(graph)
    assert totals == pytest.approx({
        "timeline/queue_s": 2.5, "timeline/prefill_s": 0.75, "timeline/resumed_s": 0.5, "timeline/decode_s": 3.25,
        "timeline/tool_s": 2.0, "timeline/preempted_s": 1.0, "timeline/trajectory_s": 10.0, "timeline/wall_s": 8.0,
        "timeline/engine_busy_s": 3.5})
    assert engine_busy_s(graph) == pytest.approx(3.5)  # [0.5, 3] ∪ [6, 7]


def test_chrome_trace_tracks_nest_and_parallel_tools_get_their_own_track(graph):
    trace = chrome_trace(graph)
    by_traj = check_trace(trace)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["a", "a tools 0", "a tools 1", "b"]
    a = by_traj["a"]
    assert [(e["ts"], e["dur"]) for e in a["generate"]] == [(1e6, 2e6), (6e6, 1e6)]
    assert {names[e["tid"]] for e in a["tool call"]} == {"a tools 0", "a tools 1"}
    assert [e["dur"] for e in a["preempted"]] == [1e6] and a["trajectory"][0]["args"]["status"] == "preempted"
    assert [e["name"] for e in by_traj["b"]["resumed"]] == ["resumed"]
    counter = [e["args"]["requests"] for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counter == [1, 2, 1, 0, 1, 0]  # b at 0.5, a at 1, b ends at 2, a at 3; a's second turn 6–7
