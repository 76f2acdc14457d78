"""Shared assertions on Chrome trace-event JSON written by :mod:`rollopt.timeline` (imported by tests)."""

from __future__ import annotations

from collections import defaultdict

from rollopt.timeline import PHASES

TOL_US = 1e-3  # the trace rounds times to nanoseconds


def check_trace(trace: dict) -> dict[str, dict[str, list[dict]]]:
    """Assert that ``trace`` is well formed; return ``{trajectory: {event name: [events]}}``.

    Well formed: known ``ph`` types with their required keys; non-negative times; every slice on a named track;
    on each track slices nested or disjoint, never crossed; on a trajectory's track the phase slices are
    disjoint and their durations add up to the ``trajectory`` slice."""
    events = trace["traceEvents"]
    named = {e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    by_track: dict[int, list[dict]] = defaultdict(list)
    by_traj: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        assert e["ph"] in {"M", "X", "i", "C"}, e
        assert {"ph", "name", "pid", "args"} <= set(e), e
        if e["ph"] in {"X", "i", "C"}:
            assert e["ts"] >= 0, e
        if e["ph"] == "C":
            assert all(v >= 0 for v in e["args"].values()), e
        if e["ph"] in {"X", "i"}:
            assert e["tid"] in named and "cat" in e, e
            by_traj[e["args"]["trajectory"]][e["name"]].append(e)
        if e["ph"] == "X":
            assert e["dur"] >= 0, e
            by_track[e["tid"]].append(e)
    for spans in by_track.values():
        stack: list[float] = []
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            start, end = e["ts"], e["ts"] + e["dur"]
            while stack and stack[-1] <= start + TOL_US:
                stack.pop()
            assert not stack or end <= stack[-1] + TOL_US, f"{e} crosses its enclosing slice"
            stack.append(end)
    for traj, kinds in by_traj.items():
        (life,) = kinds["trajectory"]
        phases = sorted((e for name in PHASES for e in kinds.get(name, []) if e["cat"] == "phase"),
                        key=lambda e: e["ts"])
        assert phases and all(e["tid"] == life["tid"] for e in phases)
        assert abs(phases[0]["ts"] - life["ts"]) <= TOL_US
        for a, b in zip(phases, phases[1:]):
            assert abs(a["ts"] + a["dur"] - b["ts"]) <= TOL_US, (a, b)  # back to back: a partition
        assert abs(sum(e["dur"] for e in phases) - life["dur"]) <= TOL_US * len(phases)
    return by_traj
