"""Experiment trackers (rollopt.trainer.trackers): two logged steps read back from what each library wrote."""

from __future__ import annotations

import json
import math
import struct
import sys
import time
import zlib
from pathlib import Path

import pytest

from rollopt.errors import ConfigError
from rollopt.trainer.trackers import (VERL_NAMES, TrackingConfig, build_trackers, parse_track, scalars)

STEPS = [
    {"step": 1, "reward_mean": 0.25, "ppo_kl": 1e-3, "rollout_s": 2.5, "staleness/mean": 0.0, "preempted": 3,
     "off_policy_correction": "tis", "eval_reward": None, "grad_norm": float("nan")},
    {"step": 2, "reward_mean": 0.5, "ppo_kl": 2e-3, "rollout_s": 2.0, "staleness/mean": 0.5, "preempted": 0,
     "off_policy_correction": "tis", "eval_reward": 0.75, "grad_norm": 0.1},
]
CONFIG = {"name": "t", "algorithm": {"lr": 1e-3}}


def test_scalars_rename_to_verl_and_keep_the_rest():
    out = scalars(STEPS[0])
    assert out == {"critic/rewards/mean": 0.25, "actor/ppo_kl": 1e-3, "timing_s/gen": 2.5, "staleness/mean": 0.0,
                   "preempted": 3.0}  # no step, no string, no None, no NaN
    assert scalars(STEPS[1], rename={})["reward_mean"] == 0.5
    assert len(set(VERL_NAMES.values())) == len(VERL_NAMES)  # one series per quantity


def test_unknown_backend_and_missing_package_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'; use any of tensorboard, wandb"):
        build_trackers(["tensorbord"], tmp_path, "t")
    with pytest.raises(ConfigError, match="unknown tracker"):
        parse_track("tensorboard,mlflow")
    assert parse_track(" tensorboard, wandb ,") == ("tensorboard", "wandb") and parse_track("") == ()
    with pytest.raises(ConfigError, match="tracking.backends"):
        TrackingConfig(backends=("csv",))
    with pytest.raises(ConfigError, match="wandb_mode"):
        TrackingConfig(wandb_mode="cloud")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb → ImportError
    with pytest.raises(ConfigError, match=r"needs the wandb package: pip install 'rollopt\[trackers\]'"):
        build_trackers(["wandb"], tmp_path, "t")


def _log_two_steps(trackers):
    for metrics in STEPS:
        for tracker in trackers:
            tracker.log(metrics, step=metrics["step"])
    for tracker in trackers:
        tracker.close()


def test_tensorboard_event_files_hold_both_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_two_steps(build_trackers(["tensorboard"], tmp_path, "t", CONFIG))
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"critic/rewards/mean", "actor/ppo_kl", "timing_s/gen", "staleness/mean", "preempted"} <= tags
    assert "reward_mean" not in tags and "off_policy_correction" not in tags
    read = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags}
    assert read["critic/rewards/mean"] == [(1, 0.25), (2, 0.5)]
    assert read["timing_s/gen"] == [(1, 2.5), (2, 2.0)]
    assert [s for s, _ in read["actor/ppo_kl"]] == [1, 2]
    assert read["actor/ppo_kl"][1][1] == pytest.approx(2e-3)
    assert read["eval_reward"] == [(2, 0.75)]  # None at step 1: a gap, not a 0
    assert read["actor/grad_norm"] == [(2, pytest.approx(0.1))]
    [text] = acc.Tensors("config/text_summary")  # the run's config, once, as text
    assert json.loads(text.tensor_proto.string_val[0].decode()) == CONFIG


def test_tensorboard_rerun_hides_the_steps_it_logs_again(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_two_steps(build_trackers(["tensorboard"], tmp_path, "t"))  # steps 1 and 2
    [resumed] = build_trackers(["tensorboard"], tmp_path, "t", first_step=2)  # a checkpoint at step 1
    resumed.log({"reward_mean": 0.125}, step=2)
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("critic/rewards/mean")] == [(1, 0.25), (2, 0.125)]


def _wandb_records(path: Path) -> list:
    """The protobuf records of a W&B transaction log (``run-*.wandb``): a 7-byte header, then LevelDB's log
    format (32 KiB blocks of ``crc32 · length · type · data`` chunks, FULL / FIRST / MIDDLE / LAST)."""
    from wandb.proto import wandb_internal_pb2

    raw, block = path.read_bytes(), 32768
    assert raw[:4] == b":W&B"
    records, pos, data = [], 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's trailer: too short for a header
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if kind == 0:  # zero padding
            pos += block - pos % block
            continue
        if pos + 7 + length > len(raw):  # still being written
            break
        chunk = raw[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pos += 7 + length
        data = chunk if kind in (1, 2) else data + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
    return records


def _finished_wandb_records(log: Path) -> list:
    """The records of an offline run's log once its exit record is written (``run.finish()`` can return before
    wandb-core has written the log out)."""
    deadline = time.monotonic() + 20
    records = _wandb_records(log)
    while not records or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, "the offline run's log has no exit record"
        time.sleep(0.1)
        records = _wandb_records(log)
    return records


def test_wandb_offline_run_holds_both_steps(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _log_two_steps(build_trackers(["wandb"], tmp_path, "calc-run", CONFIG, project="rollopt-test"))
    [log] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _finished_wandb_records(log)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("rollopt-test", "calc-run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["algorithm"] == {"lr": 1e-3}
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               | {"_step_num": r.history.step.num} for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["_step_num"] for h in history] == [1, 2]
    assert [h["critic/rewards/mean"] for h in history] == [0.25, 0.5]
    assert [h["timing_s/gen"] for h in history] == [2.5, 2.0]
    assert "eval_reward" not in history[0] and history[1]["eval_reward"] == 0.75
    assert "actor/grad_norm" not in history[0] and math.isclose(history[1]["actor/grad_norm"], 0.1)
    assert not any("reward_mean" in h or "off_policy_correction" in h for h in history)


def test_a_two_step_train_writes_tensorboard_and_a_wandb_offline_run(tmp_path, monkeypatch):
    """``rollopt train --track tensorboard,wandb``: both read back with the trainer's own step metrics."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rollopt.cli import main

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out = tmp_path / "run"
    assert main(["train", "--recipe", "recipes/calculator-tiny.toml", "--steps", "2", "--out", str(out), "-q",
                 "--track", "tensorboard,wandb", "environment.name=synthetic", "environment.options={}",
                 "warm_start.steps=0", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.extra_groups=0",
                 "rollout.eval_tasks=0", "attribution.sequences=0", "loop.mode=sync"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("critic/rewards/mean")] == [
        (r["step"], pytest.approx(r["reward_mean"])) for r in rows]
    assert [e.step for e in acc.Scalars("trained")] == [1, 2]
    [log] = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _finished_wandb_records(log)
    history = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [h["critic/rewards/mean"] for h in history] == pytest.approx([r["reward_mean"] for r in rows])


def test_bench_track_writes_the_report_to_tensorboard_and_a_wandb_offline_run(tmp_path, monkeypatch):
    """``rollopt bench --track tensorboard,wandb``: every policy's numbers, read back at step 0 from both."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rollopt.cli import main

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out, report = tmp_path / "track", tmp_path / "bench.json"
    assert main(["bench", "--engine", "sim", "--engine-option", "model_shape=llama-3.2-1b", "--workload", "tool-heavy",
                 "--tasks", "2", "--group-size", "2", "--schedulers", "sync,async+preempt", "--repeats", "1",
                 "--json", str(report), "--track", "tensorboard,wandb", "--track-dir", str(out), "-q"]) == 0
    policies = {p["scheduler"]: p for p in json.loads(report.read_text())["policies"]}
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    for name, policy in policies.items():
        for field in ("makespan_s", "efficiency", "p99_latency_s", "prefill_tokens", "lost_tokens"):
            assert [(e.step, e.value) for e in acc.Scalars(f"bench/{name}/{field}")] == [
                (0, pytest.approx(policy[field]))]
    [log] = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    records = _finished_wandb_records(log)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "bench-tool-heavy"
    assert {item.key: json.loads(item.value_json) for item in run.config.update}["engine"] == "sim"
    [history] = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                 for r in records if r.WhichOneof("record_type") == "history"]
    for name, policy in policies.items():
        assert history[f"bench/{name}/makespan_s"] == pytest.approx(policy["makespan_s"])


def test_bench_with_an_unknown_tracker_is_one_line_before_the_model_loads(tmp_path, capsys):
    from rollopt.cli import main

    assert main(["bench", "--workload", "tool-heavy", "--track", "tensorboard,mlflow",
                 "--track-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "rollopt bench: --track: unknown tracker 'mlflow'; use any of tensorboard, wandb\n"
    assert not any(tmp_path.iterdir())
