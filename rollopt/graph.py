"""The rollout dataflow graph: one ``networkx.DiGraph`` per batch, grown as episodes unfold.

Nodes are steps: ``prompt`` (a trajectory's initial prompt), ``prefill`` (a shared prefix computed once),
``fork`` (a trajectory branching into several after any step; a GRPO group is a fork after the prompt),
``generate`` (one engine request of one turn; a preempted turn resumes as a second ``generate`` node),
``tool`` (one tool call), ``observe`` (observation tokens appended), ``reward``. Edges are data
dependencies. Every node records ``kind``, ``trajectory``, ``start`` and ``end`` (seconds since the batch
began) and step-specific attributes (tokens, cached tokens, error kind, ...).

Invariant: every step the executor dispatches gets exactly one node, which ends with an ``end`` time and a
``status`` (ok / error / aborted / cancelled); nothing is dispatched without a node. Events that are not steps
(a trajectory suspended by preemption) are graph-level ``marks``; ``close`` records when the batch ended.
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

    def mark(self, trajectory: str, event: str, at: float) -> None:
        """Record an instant ``event`` of ``trajectory`` that is not a step (e.g. ``"preempted"``)."""
        self.g.graph.setdefault("marks", []).append({"trajectory": trajectory, "event": event, "at": at})

    def marks(self, event: str | None = None) -> list[dict[str, Any]]:
        return [m for m in self.g.graph.get("marks", []) if event is None or m["event"] == event]

    def close(self, at: float) -> None:
        """The batch ended at ``at`` (seconds since it began)."""
        self.g.graph["end"] = at

    @property
    def end(self) -> float:
        """When the batch ended: the ``close`` time, else the latest node end."""
        if self.g.graph.get("end") is not None:
            return self.g.graph["end"]
        return max((d["end"] for _, d in self.g.nodes(data=True) if d["end"] is not None), default=0.0)

    def chrome_trace(self) -> dict[str, Any]:
        """Chrome trace-event JSON (Perfetto loads it): per-trajectory phase timelines, see
        :mod:`rollopt.timeline`."""
        from rollopt.timeline import chrome_trace

        return chrome_trace(self)
