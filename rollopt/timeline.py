"""Per-trajectory timelines of one rollout batch, and the Chrome trace-event JSON (Perfetto) that shows them.

Each trajectory's life in the batch — from its first node to its ``reward`` node, or to the batch end if it was
preempted — is partitioned into disjoint phases (``PHASES``):

* ``prefill``: an engine request of the trajectory is in flight and has not streamed its first token yet. The
  engines report no admission time, so this *approximates* prefill by "submitted → first token received": it
  includes queueing inside the engine (waiting for a KV slot or for the next tick) and the first decode step.
  A shared-prefix ``prefill`` node (``prefix`` policies) counts here too.
* ``resumed``: the same for a request that continues a turn after an abort (a preemption or an engine pause):
  the engine recomputes prompt + partial output before the first new token.
* ``decode``: from the request's first token to its end (times are when the executor received each chunk).
* ``tool``: a tool call of the trajectory runs and no engine request of it is in flight. A tool started early
  (``overlap``) while the turn still decodes counts as ``decode`` there; every call also has its own event.
* ``preempted``: from the moment the policy suspended the trajectory to the batch end.
* ``queue``: the rest: the trajectory is ready but waits — at the policy's gate (``sync`` holds everyone until
  the turn is done everywhere), for its group's shared prefill, or inside the environment's ``step``.

Overlaps resolve by priority preempted > decode > prefill = resumed > tool > queue, so the phases of one
trajectory are disjoint and their durations sum to its lifetime. ``engine_busy_s`` is the union over all
trajectories of the intervals in which some engine request was in flight ("engine idle" is its complement in
the batch's wall time; "in flight" is not "computing", the engine's own counters measure that).

The trace (``chrome_trace``): one process; per trajectory one track holding a ``trajectory`` slice, its
``generate`` slices (one per engine request) and the phase slices nested in them, plus tracks for its tool
calls (parallel calls on separate tracks). On every track slices are nested or disjoint. Steps without
duration (prompt, fork, observe, reward) are instant events; a counter shows the requests in flight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollopt.graph import RolloutGraph

PHASES = ("queue", "prefill", "resumed", "decode", "tool", "preempted")
_PRIORITY = {"preempted": 4, "decode": 3, "prefill": 2, "resumed": 2, "tool": 1}
_ENGINE_KINDS = ("generate", "prefill")
_INSTANT_KINDS = ("prompt", "fork", "observe", "reward")


@dataclass(frozen=True)
class Span:
    phase: str
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def _timed(graph: RolloutGraph, trajectory: str | None = None) -> list[dict[str, Any]]:
    return sorted((d for _, d in graph.nodes(trajectory=trajectory) if d["start"] is not None and d["end"] is not None),
                  key=lambda d: (d["start"], d["end"]))


def lifetime(graph: RolloutGraph, trajectory: str) -> tuple[float, float]:
    """``(start, end)`` of ``trajectory`` in this batch: its first node, and its ``reward`` node or the batch end."""
    nodes = _timed(graph, trajectory)
    done = [d["end"] for d in nodes if d["kind"] == "reward"]
    return nodes[0]["start"], (done[0] if done else graph.end)


def _activity(graph: RolloutGraph, trajectory: str, end: float) -> list[Span]:
    spans: list[Span] = []
    for d in _timed(graph, trajectory):
        if d["kind"] == "generate":
            first = d.get("first_token")
            waiting = "resumed" if d.get("segment", 0) > 0 else "prefill"
            spans += [Span(waiting, d["start"], d["end"])] if first is None else \
                [Span(waiting, d["start"], first), Span("decode", first, d["end"])]
        elif d["kind"] in ("prefill", "tool"):
            spans.append(Span(d["kind"], d["start"], d["end"]))
    spans += [Span("preempted", m["at"], end) for m in graph.marks("preempted") if m["trajectory"] == trajectory]
    return spans


def trajectory_phases(graph: RolloutGraph, trajectory: str) -> list[Span]:
    """The phases of ``trajectory``, in time order, disjoint, covering exactly its :func:`lifetime`; each phase
    lies inside one ``generate`` request or outside all of them."""
    start, end = lifetime(graph, trajectory)
    activity = _activity(graph, trajectory, end)
    cuts = sorted({start, end} | {min(max(t, start), end) for s in activity for t in (s.start, s.end)})
    requests = {t for d in _timed(graph, trajectory) if d["kind"] == "generate" for t in (d["start"], d["end"])}
    out: list[Span] = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        if b <= a:
            continue
        mid = (a + b) / 2
        covering = [s.phase for s in activity if s.start <= mid <= s.end]
        phase = max(covering, key=_PRIORITY.__getitem__) if covering else "queue"
        if out and out[-1].phase == phase and a not in requests:  # a phase never crosses a request's edge
            out[-1] = Span(phase, out[-1].start, b)
        else:
            out.append(Span(phase, a, b))
    return out


def trajectories(graph: RolloutGraph) -> list[str]:
    return sorted({d["trajectory"] for d in _timed(graph)})


def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def engine_busy_s(graph: RolloutGraph) -> float:
    """Seconds of the batch in which at least one engine request was in flight."""
    return _union_s([(d["start"], d["end"]) for d in _timed(graph) if d["kind"] in _ENGINE_KINDS])


def timeline_totals(graph: RolloutGraph) -> dict[str, float]:
    """The batch's timing, for ``metrics.jsonl``: ``timeline/{phase}_s`` summed over trajectories,
    ``timeline/trajectory_s`` (their summed lifetimes, = the sum of the phases), ``timeline/wall_s`` and
    ``timeline/engine_busy_s``."""
    totals = {f"timeline/{p}_s": 0.0 for p in PHASES}
    lives = 0.0
    for traj in trajectories(graph):
        start, end = lifetime(graph, traj)
        lives += end - start
        for span in trajectory_phases(graph, traj):
            totals[f"timeline/{span.phase}_s"] += span.duration
    return {**totals, "timeline/trajectory_s": lives, "timeline/wall_s": graph.end,
            "timeline/engine_busy_s": engine_busy_s(graph)}


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _slice(name: str, cat: str, tid: int, start: float, end: float, **args: Any) -> dict[str, Any]:
    ts = _us(start)
    return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": ts, "dur": max(_us(end) - ts, 0.0),
            "args": args}


def _lanes(calls: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Tool calls packed onto as few tracks as possible, calls on one track disjoint."""
    lanes: list[list[dict[str, Any]]] = []
    for call in calls:
        lane = next((l for l in lanes if l[-1]["end"] <= call["start"]), None)
        if lane is None:
            lanes.append(lane := [])
        lane.append(call)
    return lanes


def _scalar_args(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in ("start", "end") and isinstance(v, (int, float, str, bool))}


def chrome_trace(graph: RolloutGraph) -> dict[str, Any]:
    """Chrome trace-event JSON of the batch (times in microseconds since it began); see the module docstring."""
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rollout"}}]
    tid = 0

    def track(name: str) -> int:
        nonlocal tid
        tid += 1
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid, "args": {"sort_index": tid}})
        return tid

    for traj in trajectories(graph):
        nodes = _timed(graph, traj)
        row = track(traj)
        start, end = lifetime(graph, traj)
        status = next((d["status"] for d in nodes if d["kind"] == "reward"), "preempted")
        events.append(_slice("trajectory", "trajectory", row, start, end, trajectory=traj, status=status))
        for d in nodes:
            if d["kind"] == "generate":
                events.append(_slice("generate", "engine", row, d["start"], d["end"], **_scalar_args(d)))
            elif d["kind"] in _INSTANT_KINDS:
                events.append({"ph": "i", "s": "t", "name": d["kind"], "cat": "step", "pid": 1, "tid": row,
                               "ts": _us(d["start"]), "args": _scalar_args(d)})
        events += [_slice(s.phase, "phase", row, s.start, s.end, trajectory=traj)
                   for s in trajectory_phases(graph, traj)]
        for i, lane in enumerate(_lanes([d for d in nodes if d["kind"] == "tool"])):
            lane_tid = track(f"{traj} tools {i}")
            events += [_slice("tool call", "tool", lane_tid, d["start"], d["end"], **_scalar_args(d)) for d in lane]
    requests = [d for d in _timed(graph) if d["kind"] in _ENGINE_KINDS]
    changes = sorted([(d["start"], 1) for d in requests] + [(d["end"], -1) for d in requests])  # ends first on ties
    in_flight = 0
    for t, delta in changes:
        in_flight += delta
        events.append({"ph": "C", "name": "engine requests in flight", "pid": 1, "ts": _us(t),
                       "args": {"requests": in_flight}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(graph: RolloutGraph, path: str | Path) -> Path:
    """Write ``chrome_trace(graph)`` to ``path`` (open it at https://ui.perfetto.dev)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(graph), default=str))
    return path
