"""Exact, round-tripping storage of trajectories: ``NAME.jsonl`` (one line of metadata per trajectory) plus
``NAME.npz`` (the token arrays of all trajectories, concatenated, with offsets).

Token arrays are stored in binary, so logprobs (NaN included) and versions come back bit for bit.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from rollopt.errors import ErrorRecord
from rollopt.trajectory import Status, ToolCall, ToolResult, Trajectory, Turn

_ARRAYS = ("token_ids", "logprobs", "versions", "kinds")


def _turn_to_dict(turn: Turn) -> dict[str, Any]:
    data = asdict(turn)
    data["tool_results"] = [
        {**asdict(r), "error": r.error.to_dict() if r.error else None} for r in turn.tool_results
    ]
    data["parse_errors"] = [e.to_dict() for e in turn.parse_errors]
    return data


def _turn_from_dict(data: dict[str, Any]) -> Turn:
    return Turn(
        **{k: v for k, v in data.items() if k not in ("tool_calls", "tool_results", "parse_errors")},
        tool_calls=[ToolCall(**c) for c in data["tool_calls"]],
        tool_results=[
            ToolResult(**{**r, "error": ErrorRecord.from_dict(r["error"]) if r["error"] else None})
            for r in data["tool_results"]
        ],
        parse_errors=[ErrorRecord.from_dict(e) for e in data["parse_errors"]],
    )


def save_trajectories(path: str | Path, trajectories: Iterable[Trajectory]) -> tuple[Path, Path]:
    """Write ``path.jsonl`` and ``path.npz``; return both paths."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    trajs = list(trajectories)
    offsets = np.r_[0, np.cumsum([len(t) for t in trajs])].astype(np.int64)
    arrays = {name: np.concatenate([getattr(t, name) for t in trajs]) if trajs else np.zeros(0) for name in _ARRAYS}
    npz_path, jsonl_path = base.with_suffix(".npz"), base.with_suffix(".jsonl")
    np.savez(npz_path, offsets=offsets, **arrays)
    with jsonl_path.open("w") as fh:
        for traj in trajs:
            record = {
                "id": traj.id,
                "task_id": traj.task_id,
                "group_id": traj.group_id,
                "turns": [_turn_to_dict(t) for t in traj.turns],
                "reward": traj.reward,
                "reward_components": traj.reward_components,
                "status": traj.status.value,
                "error": traj.error.to_dict() if traj.error else None,
                "metadata": traj.metadata,
            }
            fh.write(json.dumps(record) + "\n")
    return jsonl_path, npz_path


def load_trajectories(path: str | Path) -> list[Trajectory]:
    """Read what :func:`save_trajectories` wrote; every trajectory is re-validated on construction."""
    base = Path(path)
    with np.load(base.with_suffix(".npz")) as npz:
        offsets = npz["offsets"]
        arrays = {name: npz[name] for name in _ARRAYS}
    lines = base.with_suffix(".jsonl").read_text().splitlines()
    if len(lines) != len(offsets) - 1:
        raise ValueError(f"{base}: {len(lines)} metadata lines but {len(offsets) - 1} token records")
    out = []
    for i, line in enumerate(lines):
        rec = json.loads(line)
        lo, hi = offsets[i], offsets[i + 1]
        out.append(
            Trajectory(
                id=rec["id"],
                task_id=rec["task_id"],
                group_id=rec["group_id"],
                **{name: arrays[name][lo:hi] for name in _ARRAYS},
                turns=[_turn_from_dict(t) for t in rec["turns"]],
                reward=rec["reward"],
                reward_components=rec["reward_components"],
                status=Status(rec["status"]),
                error=ErrorRecord.from_dict(rec["error"]) if rec["error"] else None,
                metadata=rec["metadata"],
            )
        )
    return out
