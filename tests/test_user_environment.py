"""A user's environment, written from README alone (the code is taken from README's "Use your own
environment" section), runs through every command: by file path, by import path and by entry point."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollopt.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_environment() -> str:
    section = README.read_text().split("## Use your own environment", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture()
def trip_file(tmp_path) -> Path:
    path = tmp_path / "trip_env.py"
    path.write_text(readme_environment())
    return path


def test_the_readme_environment_runs_through_rollout_bench_validate_and_train(trip_file, tmp_path, capsys):
    spec = f"{trip_file}:TripEnv"
    assert main(["rollout", "--env", spec, "-o", "planned=true", "--tasks", "2", "--group-size", "2", "-q",
                 "--out", str(tmp_path / "trajs")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "trajs.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:  # three tools with different latencies, two planned turns, a reward read from turn 0
        assert [c["name"] for t in row["turns"] for c in t["tool_calls"]] == ["search_flights", "weather", "book"]
        assert row["reward"] == 1.0
    report = tmp_path / "bench.json"
    assert main(["bench", "--workload", spec, "-o", "planned=true", "--schedulers", "sync,async", "--repeats", "1",
                 "--tasks", "2", "--group-size", "2", "--json", str(report), "-q"]) == 0
    assert [p["scheduler"] for p in json.loads(report.read_text())["policies"]] == ["sync", "async"]
    assert main(["bench", "--workload", spec, "-o", "planned=true", "--engine", "sim", "--engine-option",
                 "model_shape=llama-3.2-1b", "--schedulers", "sync,async", "--repeats", "1", "--tasks", "2",
                 "--group-size", "2", "--json", str(report), "-q"]) == 0  # the simulated engine, virtual time
    simulated = json.loads(report.read_text())
    assert simulated["engine"] == "sim" and "projection" in simulated["engine_description"]
    assert all(p["tokens_generated"] > 0 and p["lost_tokens"] == 0 for p in simulated["policies"])
    checks = tmp_path / "validate.json"
    assert main(["validate", "--env", spec, "-o", "planned=true", "--scheduler", "async", "--check", "token-parity",
                 "--json", str(checks), "-q"]) == 0
    assert [(r["check"], r["passed"]) for r in json.loads(checks.read_text())] == [("token-parity", True)]
    out = tmp_path / "run"
    assert main(["train", "--recipe", "recipes/calculator-tiny.toml", "--steps", "2", "--out", str(out), "-q",
                 f"environment.name={spec}", "environment.options={planned = true}", "warm_start.steps=0",
                 "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.extra_groups=0",
                 "rollout.eval_tasks=0", "attribution.sequences=0", "loop.mode=sync"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["reward_mean"] == 1.0 for m in metrics)


def test_an_installed_package_environment_is_found_by_its_entry_point(tmp_path, monkeypatch, capsys):
    """What ``pip install`` of a package declaring ``[project.entry-points."rollopt.environments"]`` leaves:
    a module and a dist-info with the entry point; then the plain name works everywhere."""
    (tmp_path / "trip_pkg").mkdir()
    (tmp_path / "trip_pkg" / "__init__.py").write_text(readme_environment())
    info = tmp_path / "trip_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trip-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rollopt.environments]\ntrip = trip_pkg:TripEnv\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["rollout", "--env", "trip", "-o", "planned=true", "--tasks", "1", "--group-size", "2", "-q"]) == 0
    assert main(["rollout", "--env", "trip_pkg:TripEnv", "--tasks", "1", "--group-size", "2", "-q"]) == 0
    assert main(["rollout", "--env", "trip", "-o", "plannd=true"]) == 2
    assert "unexpected keyword argument 'plannd'" in capsys.readouterr().err
