"""`rollopt report` on a short training run: the PNGs exist, and the summary's dominant-cost sentence agrees
with the per-step Perfetto traces the run wrote."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
from trace_checks import check_trace

from rollopt.cli import main
from rollopt.report import PHASE_LABELS
from rollopt.timeline import PHASES
from rollopt.trainer.loop import Trainer
from rollopt.trainer.recipe import load_recipe

RECIPE = """
name = "report-small"
[model]
init_scale = 0.3
[environment]
name = "synthetic"
[environment.options]
turns = [2, 3]
tokens_per_turn = [6, 10]
tool_latency_s = 0.05
prompt_words = 12
[rollout]
scheduler = "overlap+prefix+preempt"
tasks_per_step = 2
extra_groups = 1
group_size = 4
max_new_tokens = 16
[algorithm]
micro_batch = 4
[off_policy]
max_staleness = 1
[loop]
mode = "async"
steps = 3
"""


def _busy_us(counter: list[dict]) -> float:
    """Time with at least one engine request in flight, from the trace's counter track."""
    busy, since = 0.0, None
    for e in sorted(counter, key=lambda e: e["ts"]):
        if e["args"]["requests"] > 0 and since is None:
            since = e["ts"]
        elif e["args"]["requests"] == 0 and since is not None:
            busy, since = busy + e["ts"] - since, None
    return busy


async def test_report_renders_pngs_and_names_the_dominant_cost_measured_in_the_traces(tmp_path, capsys):
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(RECIPE)
    run = tmp_path / "run"
    await Trainer(load_recipe(recipe_path), run).run()
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    for name in ("reward", "length", "staleness", "mismatch", "time"):
        assert (run / "report" / f"{name}.png").stat().st_size > 5_000
    phase_us: dict[str, float] = defaultdict(float)
    lives_us = busy_us = 0.0
    for path in sorted((run / "traces").glob("step-*.trace.json")):
        trace = json.loads(path.read_text())
        for events in check_trace(trace).values():
            lives_us += events["trajectory"][0]["dur"]
            for phase in PHASES:
                phase_us[phase] += sum(e["dur"] for e in events.get(phase, []) if e["cat"] == "phase")
        busy_us += _busy_us([e for e in trace["traceEvents"] if e["ph"] == "C"])
    wall_s = sum(json.loads(line)["timeline/wall_s"] for line in (run / "metrics.jsonl").read_text().splitlines())
    label, share, idle = re.search(r"dominant cost: (.+) (\d+)% of trajectory time; engine idle (\d+)% of rollout "
                                   r"wall time", out).groups()
    dominant = max(phase_us, key=phase_us.__getitem__)
    assert label == PHASE_LABELS[dominant]
    assert int(share) == pytest.approx(100 * phase_us[dominant] / lives_us, abs=0.5 + 1e-6)
    assert int(idle) == pytest.approx(100 * (1 - busy_us / 1e6 / wall_s), abs=0.5 + 1e-6)
    assert "trajectory time: queue wait" in out and "stale tokens rescored" in out


def test_report_on_a_directory_without_metrics_names_the_fix(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "rollopt train --out" in capsys.readouterr().err
