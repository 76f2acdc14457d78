"""Plug-in points need no core edit: an engine and a scheduler registered from test code run through
``rollout``, ``bench`` and a 2-step ``train``; configuration errors are one line naming the key, before any
model loads."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import ClassVar

import pytest

from rollopt import ScriptedEngine
from rollopt.cli import main
from rollopt.engines import ENGINES, register_engine
from rollopt.schedulers import SCHEDULERS, register_scheduler
from rollopt.schedulers.per_trajectory import AsyncPolicy


@dataclass(frozen=True)
class ToyEngineConfig:
    """A scripted engine: every turn is ``tokens`` copies of one token id."""

    kind: ClassVar[str] = "toy"
    tokens: int = 5
    token_delay_s: float = 0.0005


class ToyPolicy(AsyncPolicy):
    name = "toyfifo"


opened: list[ToyEngineConfig] = []


@asynccontextmanager
async def open_toy(config: ToyEngineConfig, model, context):
    opened.append(config)
    vocab = len(model.tokenizer)
    yield ScriptedEngine(lambda req: [7] * min(config.tokens, req.sampling.max_new_tokens), vocab_size=vocab,
                         token_delay_s=config.token_delay_s)


@pytest.fixture()
def toy_plugins(monkeypatch):
    monkeypatch.setitem(ENGINES, "toy", ENGINES.get("toy"))  # restored after the test
    monkeypatch.setitem(SCHEDULERS, "toyfifo", None)
    register_engine("toy", ToyEngineConfig, open_toy)
    register_scheduler("toyfifo", ToyPolicy)
    opened.clear()


def test_rollout_bench_and_train_run_a_registered_engine_and_scheduler(toy_plugins, tmp_path, capsys):
    assert main(["rollout", "--env", "synthetic", "--engine", "toy", "--engine-option", "tokens=3",
                 "--scheduler", "toyfifo", "--tasks", "2", "--group-size", "2", "-q"]) == 0
    assert opened[-1] == ToyEngineConfig(tokens=3)
    report = tmp_path / "bench.json"
    assert main(["bench", "--engine", "toy", "--workload", "group-prefix", "--schedulers", "sync,toyfifo",
                 "--repeats", "1", "--tasks", "2", "--group-size", "2", "--json", str(report), "-q"]) == 0
    data = json.loads(report.read_text())
    assert data["engine"] == "toy" and [p["scheduler"] for p in data["policies"]] == ["sync", "toyfifo"]
    assert all(p["tokens_generated"] == 2 * 2 * 5 for p in data["policies"])  # the toy engine's 5 per turn
    out = tmp_path / "run"
    assert main(["train", "--recipe", "recipes/calculator-tiny.toml", "--out", str(out), "--steps", "2",
                 "warm_start.steps=0", "environment.name=synthetic", "environment.options={}",
                 "rollout.engine=toy", "rollout.engine_options={tokens = 4}", "rollout.scheduler=toyfifo",
                 "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.extra_groups=0",
                 "rollout.eval_tasks=0", "attribution.sequences=0", "loop.mode=sync"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and opened[-1] == ToyEngineConfig(tokens=4)
    assert all(r["trained"] == r["started"] == 4 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["rollout", "--scheduler", "overlap+prefx"], "unknown scheduler ['prefx']"),
    (["rollout", "--env", "calculatr"], "unknown environment 'calculatr'"),
    (["rollout", "-o", "dificulty=2"], "unexpected keyword argument 'dificulty'"),
    (["rollout", "--engine", "simm"], "unknown engine 'simm'"),
    (["rollout", "--engine-option", "max_running=many"], "engine.max_running = 'many': expected int"),
    (["bench", "--workload", "swe"], "unknown workload 'swe'"),
    (["bench", "--schedulers", "sync,overlapp"], "unknown scheduler ['overlapp']"),
    (["train", "--recipe", "recipes/calculator-tiny.toml", "rollout.tasks_per_step=many"],
     "rollout.tasks_per_step = 'many': expected int"),
    (["train", "--recipe", "recipes/calculator-tiny.toml", "rollout.scheduler=overlap+prefx"],
     "rollout.scheduler: unknown scheduler"),
    (["train", "--recipe", "recipes/calculator-tiny.toml", "environment.options.dificulty=2"], "'dificulty'"),
    (["train", "--recipe", "recipes/calculator-tiny.toml", "rollout.temperature=0"], "rollout.temperature = 0"),
    (["train", "--recipe", "recipes/calculator-tiny.toml", "off_policy.stale=sometimes"],
     "off_policy.stale = 'sometimes'"),
    (["train", "--recipe", "missing.toml"], "does not exist"),
])
def test_every_config_error_is_one_line_before_any_model_loads(argv, message, capsys, monkeypatch):
    import rollopt.modeling

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the configuration was checked")

    monkeypatch.setattr(rollopt.modeling, "load_model", no_model)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith(f"rollopt {argv[0]}: ") and "\n" not in err
