"""The training loop on the embedded engine: on-policy sanity, staleness in the async modes, weight sync,
recipes, checkpoints and an exact resume after the training process is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollopt.errors import ConfigError
from rollopt.trainer.loop import Trainer
from rollopt.trainer.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
SMALL_RECIPE = """
name = "small"
[model]
init_scale = 0.3
[environment]
name = "synthetic"
[environment.options]
turns = [2, 3]
tokens_per_turn = [6, 10]
tool_latency_s = 0.01
prompt_words = 12
[rollout]
tasks_per_step = 2
group_size = 4
max_new_tokens = 16
temperature = 0.8
[algorithm]
micro_batch = 4
lr = 1e-3
"""
"""Synthetic episodes (real decode, planned tool waits, a reward that varies with the text): every group has
nonzero advantages, so each step really moves the weights."""


@pytest.fixture()
def recipe_path(tmp_path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL_RECIPE)
    return path


def small(path: Path, *overrides: str):
    return load_recipe(path, list(overrides))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_first_step_is_on_policy_trainer_matches_the_fp32_engine(tmp_path, recipe_path):
    """slime's sanity check: with the fp32 local engine, step 1's trainer logprobs equal the engine's sampling
    logprobs (of the tempered distribution). ``ppo_kl`` averages every minibatch: the second trains weights the
    first optimizer step moved, so it is > 0 (before, it was read on the first minibatch only: always 0)."""
    trainer = Trainer(small(recipe_path, "loop.steps=2", "rollout.scheduler=sync", "algorithm.minibatches=2"), tmp_path)
    await trainer.run()
    first, second = read(tmp_path / "metrics.jsonl")
    assert first["step"] == 1 and first["policy_version"] == 1 and second["policy_version"] == 2
    assert first["mismatch/lag0/tokens"] > 0 and first["staleness/lag0_frac"] == 1.0
    assert first["mismatch/lag0/abs_dlogp"] < 1e-4 and first["ppo_kl"] > 0
    assert first["grad_norm"] > 0 and first["train_tokens"] == first["mismatch/lag0/tokens"]
    # the second step was sampled by the synced version-1 weights: still on-policy
    assert second["mismatch/lag0/abs_dlogp"] < 1e-4 and second["staleness/max"] == 0
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "recipe.toml").exists()
    resolved = load_recipe(tmp_path / "recipe.toml")
    assert resolved == trainer.recipe


async def test_one_step_off_trains_on_tokens_one_version_old(tmp_path, recipe_path):
    trainer = Trainer(small(recipe_path, "loop.steps=4", "loop.mode=one-step-off", "rollout.scheduler=overlap"), tmp_path)
    await trainer.run()
    rows = read(tmp_path / "metrics.jsonl")
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["staleness/max"] == 0  # nothing to lag behind at the start
    assert all(r["staleness/max"] <= 1 for r in rows) and any(r.get("staleness/lag1_frac", 0) > 0 for r in rows[1:])
    lagged = [r for r in rows if r.get("mismatch/lag1/tokens")]
    # tokens one version old differ from the trainer's logprobs; every step's lag-0 tokens do not — also those
    # decoded after a weight update landed mid-request: the engine retracts the request around the update and
    # re-prefills it on the new weights (before, it decoded them on KV the old weights had computed: 0.19
    # mismatch on 46 "lag-0" tokens in one run of six, measured 2e-6 since)
    assert lagged and all(r["mismatch/lag1/abs_dlogp"] > 1e-2 for r in lagged)
    assert all(r["mismatch/lag0/abs_dlogp"] < 1e-4 for r in rows if r.get("mismatch/lag0/tokens"))


async def test_async_with_preemption_bounds_staleness_and_applies_the_correction(tmp_path, recipe_path):
    trainer = Trainer(small(recipe_path, "loop.steps=4", "loop.mode=async", "off_policy.max_staleness=1",
                            "off_policy.correction=tis", "rollout.scheduler=overlap+prefix+preempt",
                            "rollout.extra_groups=1"), tmp_path)
    await trainer.run()
    rows = read(tmp_path / "metrics.jsonl")
    assert len(rows) == 4 and sum(r["preempted"] for r in rows) > 0
    assert any(r["staleness/max"] >= 1 for r in rows)
    # every token past the bound was dropped, none trained: train_tokens counts the kept ones only
    for r in rows:
        kept = sum(r.get(f"mismatch/{b}/tokens", 0) for b in ("lag0", "lag1", "lag2plus")) - r["stale_dropped_tokens"]
        assert r["train_tokens"] == kept
    assert all(r["off_policy_correction"] == "tis" for r in rows)
    # the rescoring split: the fp32 engine computes what the trainer computes — also for requests a weight update
    # landed in (retracted and re-prefilled on the new weights; before, their KV mixed versions and the numerics
    # share reached 0.12 against a lag share of 0.19), so the stale tokens' gap is version lag alone
    split = [r for r in rows if r.get("attribution/tokens")]
    assert split and all(r["attribution/unattributed_tokens"] == 0 for r in split)
    for r in split:
        assert r["attribution/numerics_abs_dlogp"] < 1e-4 and r["attribution/lag_abs_dlogp"] > 1e-2
        assert r["attribution/total_dlogp"] == pytest.approx(r["attribution/numerics_dlogp"] + r["attribution/lag_dlogp"])
    # every step's rollout timeline: a trace file, and phase times that add up to the trajectories' time
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [f"step-000{i}.trace.json" for i in (1, 2, 3, 4)]
    for r in rows:
        phases = sum(r[f"timeline/{p}_s"] for p in ("queue", "prefill", "resumed", "decode", "tool", "preempted"))
        assert phases == pytest.approx(r["timeline/trajectory_s"])
        assert 0 < r["timeline/engine_busy_s"] <= r["timeline/wall_s"]
    assert sum(r["timeline/preempted_s"] for r in rows) > 0


def test_recipe_errors_name_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="unknown key.*rollout.schedular"):
        load_recipe(None, ["rollout.schedular=sync"])
    with pytest.raises(ConfigError, match="max_staleness"):
        load_recipe(None, ["loop.mode=async"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_recipe(None, ["steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[loop\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(bad)
    shipped = sorted((REPO / "recipes").glob("*.toml"))
    assert {p.stem for p in shipped} >= {"calculator-tiny", "calculator-smollm2", "gpu-sglang"}
    for path in shipped:
        recipe = load_recipe(path)
        assert recipe.name == path.stem and load_recipe(None, []) != recipe


def _train_cmd(recipe: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollopt.cli", "train", "--recipe", str(recipe), "--out", str(out), "--steps", "4",
            "loop.mode=sync", "rollout.scheduler=sync", *extra]


def test_killed_training_resumes_from_its_checkpoint_at_the_same_step(tmp_path, recipe_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    straight = tmp_path / "straight"
    subprocess.run(_train_cmd(recipe_path, straight), check=True, env=env, capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(recipe_path, killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        latest = killed / "checkpoints" / "latest"
        while not ((latest / "DONE").exists() and latest.resolve().name >= "step-000002"):
            assert proc.poll() is None, "training ended before it could be killed"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    done = {r["step"] for r in read(killed / "metrics.jsonl")}
    assert 2 <= max(done) < 4
    resumed = subprocess.run(_train_cmd(recipe_path, killed, "--resume"), env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    a, b = read(straight / "metrics.jsonl"), read(killed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4] and [r["policy_version"] for r in b] == [1, 2, 3, 4]
    keys = ("reward_mean", "response_length_mean", "loss", "grad_norm", "train_tokens")
    assert [[r[k] for k in keys] for r in b] == [[r[k] for k in keys] for r in a]  # identical to the straight run


def test_train_cli_reports_a_bad_recipe_and_names_the_fix(tmp_path, capsys, recipe_path):
    from rollopt.cli import main

    assert main(["train", "--recipe", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist; see recipes/" in capsys.readouterr().err
    assert main(["train", "--recipe", str(recipe_path), "loop.mode=asynch"]) == 2
    assert "loop.mode 'asynch'; use one of" in capsys.readouterr().err


ENTERED_ENV = '''
from pathlib import Path

from rollopt.environments import SyntheticEnv


class EnteredEnv(SyntheticEnv):
    """Logs its lifetime: a reset outside ``async with env`` would find no resources (a sandbox pool, a DB)."""

    def __init__(self, log: str) -> None:
        super().__init__(turns=(1, 1), tokens_per_turn=(4, 8))
        self.log, self.inside = Path(log), False

    def _write(self, event: str) -> None:
        with self.log.open("a") as f:
            f.write(event + "\\n")

    async def __aenter__(self):
        self.inside = True
        self._write("enter")
        return self

    async def __aexit__(self, *exc_info):
        self.inside = False
        self._write("exit")

    def reset(self, task):
        self._write("reset inside" if self.inside else "reset outside")
        return super().reset(task)
'''


def test_train_runs_its_episodes_inside_the_environments_async_with(tmp_path):
    """The trainer enters its environment around the run (as rollout and bench do), so an environment that
    acquires resources in ``__aenter__`` (``python_tool``'s sandbox pool) can be trained on."""
    from rollopt.cli import main

    (tmp_path / "entered_env.py").write_text(ENTERED_ENV)
    log = tmp_path / "events.log"
    assert main(["train", "--recipe", "recipes/calculator-tiny.toml", "--steps", "2", "--out", str(tmp_path / "run"),
                 "-q", f"environment.name={tmp_path / 'entered_env.py'}:EnteredEnv",
                 f"environment.options={{log = '{log}'}}", "warm_start.steps=0", "rollout.tasks_per_step=2",
                 "rollout.group_size=2", "rollout.extra_groups=0", "rollout.eval_tasks=0", "attribution.sequences=0",
                 "loop.mode=sync"]) == 0
    events = log.read_text().split("\n")[:-1]
    assert events[0] == "enter" and events[-1] == "exit" and events.count("enter") == 1
    assert events.count("reset inside") == 2 * 2 * 2 and "reset outside" not in events  # steps × tasks × group
