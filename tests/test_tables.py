"""Tables that fit (rollopt.tables): the real bench table at 80 and 120 columns and in a pipe, with no value cut."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.cells import cell_len
from rich.console import Console

from rollopt.benchmark.report import table as bench_table
from rollopt.benchmark.report import tracker_metrics
from rollopt.display import summary_table
from rollopt.tables import Column, FitTable, plan, render_text

REPORT = json.loads((Path(__file__).parent.parent / "bench" / "results" / "tool-heavy.json").read_text())


def _print(renderable, **console_kwargs) -> str:
    console = Console(file=io.StringIO(), force_terminal=False, **console_kwargs)
    console.print(renderable)
    return console.file.getvalue()


def _assert_whole(text: str, fit: FitTable, width: int) -> None:
    """Nothing cut, nothing past the width, and every shown value whole on its row's line, in column order."""
    assert "…" not in text and "..." not in text
    lines = text.splitlines()
    assert all(cell_len(line.rstrip()) <= width for line in lines), max(lines, key=cell_len)
    layout = fit.layout(width)
    assert not layout.transposed
    for row in fit.cells:
        [line] = [line for line in lines if line.split() and line.split()[0] == row[0]]  # the policy, in full
        pos = 0
        for i in layout.shown:
            found = line.find(row[i], pos)
            assert found >= 0, (row[i], line)
            pos = found + len(row[i])
    for i in layout.dropped:  # named under the table
        assert fit.columns[i].header in " ".join(text.split())


@pytest.mark.parametrize("width", [80, 120])
def test_bench_table_fits_without_cutting_a_value(width):
    fit = bench_table(REPORT)
    text = _print(fit, width=width)
    _assert_whole(text, fit, width)
    shown = {fit.columns[i].header for i in fit.layout(width).shown}
    assert {"scheduler", "makespan s", "speedup vs sync"} <= shown  # the essentials
    if width == 80:
        assert "more in --json:" in text
    else:
        assert len(shown) > len({fit.columns[i].header for i in fit.layout(80).shown})


def test_bench_table_in_a_pipe(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    fit = bench_table(REPORT)
    text = _print(fit)  # no width, not a terminal: rich's 80
    _assert_whole(text, fit, 80)
    assert text == render_text(fit, 80)
    for p in REPORT["policies"]:
        assert p["scheduler"] in text.split()


def test_too_narrow_for_the_essentials_turns_the_table():
    fit = bench_table(REPORT)
    assert fit.layout(30).transposed
    text = render_text(fit, 30)
    assert "…" not in text
    assert all(cell_len(line.rstrip()) <= 30 for line in text.splitlines())
    flat = " ".join(text.split())
    for row in fit.cells:
        assert all(" ".join(value.split()) in flat for value in row)  # every value, of every column


def test_plan_adds_columns_by_priority_and_stops_after_a_skip():
    cols = [Column("a", "a"), Column("b", "b", priority=1), Column("c", "c", priority=1),
            Column("d", "d", priority=2)]
    cells = [["x" * 10, "y" * 10, "z" * 3, "w"]]
    assert plan(cols, cells, 40) == plan(cols, cells, 40)
    assert plan(cols, cells, 40).shown == (0, 1, 2, 3)
    assert plan(cols, cells, 17).shown == (0, 2)  # b skipped, c fits; d (a later level) is not tried
    assert plan(cols, cells, 17).dropped == (1, 3)
    assert plan(cols, cells, 9).transposed


def test_rollout_summary_fits_80_columns():
    trajs = [SimpleNamespace(reward=1.0, num_generated=96, tool_calls=[0, 1])] * 64
    fit = summary_table(trajs, 12.345, SimpleNamespace(prefill_tokens=123456, cached_tokens=654321))
    _assert_whole(render_text(fit, 80), fit, 80)
    assert len(fit.layout(80).shown) == len(fit.columns)


def test_bench_tracker_metrics_are_flat_numbers():
    metrics = tracker_metrics(REPORT)
    assert metrics["bench/async/speedup_vs_sync"] == pytest.approx(REPORT["policies"][1]["speedup_vs_sync"])
    assert all(isinstance(v, float) for v in metrics.values())
    assert not any(k.endswith("/scheduler") or k.endswith("/timeline") for k in metrics)


def test_values_and_headers_are_text_not_markup():
    fit = FitTable([{"name": "[red]x[/]", "range": "[1-2]"}], [Column("name", "name [b]"), Column("range", "r")])
    text = render_text(fit, 40)
    assert "[red]x[/]" in text and "[1-2]" in text and "name [b]" in text
