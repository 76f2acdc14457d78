"""The rollout dataflow graph: one ``networkx.DiGraph`` per batch, grown as episodes unfold.

Nodes are steps: ``prompt`` (a trajectory's initial prompt), ``prefill`` (a shared prefix computed once),
``fork`` (a trajectory branching into several after any step; a GRPO group is a fork after the prompt),
``generate`` (one engine request of one turn; a preempted turn resumes as a second ``generate`` node),
``tool`` (one tool call), ``observe`` (observation tokens appended), ``reward``. Edges are data
dependencies. Every node records ``kind``, ``trajectory``, ``start`` and ``end`` (seconds since the batch
began) and step-specific attributes (tokens, cached tokens, error kind, ...).

Invariant: every step the executor dispatches gets exactly one node, which ends with an ``end`` time and a
``status`` (ok / error / aborted / cancelled); nothing is dispatched without a node.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import networkx as nx

NODE_KINDS = ("prompt", "prefill", "fork", "generate", "tool", "observe", "reward")


class RolloutGraph:
    def __init__(self) -> None:
        self.g = nx.DiGraph()
        self._ids = itertools.count()

    def add(self, kind: str, trajectory: str, after: str | list[str] | None = None, start: float | None = None,
            **attrs: Any) -> str:
        """Add a step node depending on ``after``; return its id."""
        if kind not in NODE_KINDS:
            raise ValueError(f"unknown node kind {kind!r}")
        node = f"{kind}:{trajectory}:{next(self._ids)}"
        self.g.add_node(node, kind=kind, trajectory=trajectory, start=start, end=None, status="running", **attrs)
        for parent in [after] if isinstance(after, str) else (after or []):
            if parent is not None:
                self.g.add_edge(parent, node)
        return node

    def finish(self, node: str, end: float, status: str = "ok", **attrs: Any) -> None:
        data = self.g.nodes[node]
        if data["end"] is not None:
            raise ValueError(f"node {node} finished twice")
        data.update(end=end, status=status, **attrs)

    def fork(self, parent: str, trajectories: list[str], at: float) -> list[str]:
        """Branch ``parent`` into one ``fork`` node per child trajectory; return the fork nodes."""
        nodes = [self.add("fork", child, after=parent, start=at) for child in trajectories]
        for node in nodes:
            self.finish(node, at)
        return nodes

    def nodes(self, kind: str | None = None, trajectory: str | None = None) -> list[tuple[str, dict]]:
        return [(n, d) for n, d in self.g.nodes(data=True)
                if (kind is None or d["kind"] == kind) and (trajectory is None or d["trajectory"] == trajectory)]

    def unfinished(self) -> list[str]:
        return [n for n, d in self.g.nodes(data=True) if d["end"] is None]

    def to_json(self) -> dict[str, Any]:
        return nx.node_link_data(self.g, edges="edges")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), default=str))
        return path

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (Perfetto loads it): one complete event ("ph": "X", microseconds) per timed
        node, on one track (tid) per trajectory, plus one track per tool call so that parallel calls never
        overlap on a track."""
        def track(d: dict) -> str:
            return f"{d['trajectory']} tool {d.get('call', '')}" if d["kind"] == "tool" else d["trajectory"]

        tids = {t: i for i, t in enumerate(sorted({track(d) for _, d in self.g.nodes(data=True)}))}
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": t}} for t, i in tids.items()
        ]
        for node, d in self.g.nodes(data=True):
            if d["start"] is None or d["end"] is None:
                continue
            args = {k: v for k, v in d.items() if k not in ("start", "end") and isinstance(v, (int, float, str, bool))}
            events.append({"ph": "X", "name": d["kind"], "cat": d["kind"], "pid": 1, "tid": tids[track(d)],
                           "ts": d["start"] * 1e6, "dur": max(d["end"] - d["start"], 0.0) * 1e6,
                           "args": {"node": node, **args}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
