"""Calibrating the simulated engine to a real one (rollopt.engines.sim_calibration, ``rollopt calibrate``): the
method recovers a known cost exactly, the command writes a cost file the sim replays, a bad file is one line."""

from __future__ import annotations

import json

import anyio
import pytest
import trio.testing

from rollopt.cli import main
from rollopt.config import SimEngineConfig
from rollopt.engines.sim import SimEngine
from rollopt.engines.sim_calibration import DEFAULT_PROBES, EngineSizes, calibrate, load_cost_file
from rollopt.engines.sim_cost import LinearCost
from rollopt.errors import ConfigError


def test_calibrating_against_a_simulated_engine_of_known_cost_recovers_that_cost():
    """On the virtual clock a probe's measured time is the sum of its iterations' costs (each rounded up to a
    1 ns tick of the clock's grid), so the fit must give back the coefficients the engine was built with (every
    term, including the optional two)."""
    truth = LinearCost(2e-3, 3e-5, 4e-4, 5e-8, 2e-9, 6e-4)
    sizes = EngineSizes(max_running=64, prefill_chunk=512, block_size=16, max_context=4096, kv_tokens=327_680)
    config = SimEngineConfig(kv_tokens=sizes.kv_tokens, max_running=64, prefill_chunk=512, max_context=4096)

    async def fit():
        async with SimEngine(truth, sizes.kv_tokens, config, vocab_size=2000) as engine:
            return await calibrate(engine, sizes, "sim truth", repeats=1)

    result = anyio.run(fit, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})
    assert result.cost.coefficients == pytest.approx(truth.coefficients, rel=1e-6)
    assert result.max_rel_error < 1e-7  # the ticks: up to 1 ns on iterations of 2 ms and more
    assert len(result.probes) == len(DEFAULT_PROBES)
    assert result.cost.name.startswith("fitted:sim truth (linear, 24 probes")


def test_rollopt_calibrate_writes_a_cost_file_that_the_sim_replays(tmp_path, capsys):
    """``rollopt calibrate`` on the real embedded engine, then ``bench --engine sim`` with its file: the sim
    takes the engine's sizes and cost, says what it was fitted to (not a projection), and ranks ``async``
    ahead of ``sync`` on a tool workload (the real engine's order there: 3.1× in bench/results/sim-vs-local.json)."""
    cost = tmp_path / "local.json"
    assert main(["calibrate", "--repeats", "1", "--out", str(cost)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {cost}" in out and "…" not in out
    data = json.loads(cost.read_text())
    assert data["format"] == "rollopt-cost/1" and data["fitted_to"] == "local tiny-llama"
    assert set(data["coefficients"]) == {"fixed_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s",
                                         "per_attention_pair_s", "per_prefill_seq_s"}
    assert min(data["coefficients"].values()) >= 0 and data["coefficients"]["fixed_s"] > 0
    assert data["engine"] == {"max_running": 64, "prefill_chunk": 512, "block_size": 16, "max_context": 4096,
                              "kv_tokens": 65536 + 64 * 4096,  # the bench's embedded engine: cache + slots
                              "defer_shared_prefill": True,  # it holds a sibling while its shared prompt prefills
                              "mixed_prefill": True}  # a tick prefills and decodes
    assert [(p["batch"], p["prompt_tokens"], p["new_tokens"]) for p in data["probes"]] == [
        (p.batch, p.prompt_tokens, p.new_tokens) for p in DEFAULT_PROBES]
    assert all(len(p["measured_s"]) == 1 and p["measured_s"][0] > 0 for p in data["probes"])
    loaded = load_cost_file(cost)
    config = SimEngineConfig(cost_file=str(cost))
    assert (config.linear, config.fitted_to, config.kv_tokens, config.max_running, config.prefill_chunk) == (
        loaded.linear, "local tiny-llama", 65536 + 64 * 4096, 64, 512)
    assert SimEngineConfig(cost_file=str(cost), max_running=8).max_running == 8  # a given size wins

    report = tmp_path / "sim.json"
    assert main(["bench", "--engine", "sim", "--engine-option", f"cost_file={cost}", "--workload", "tool-heavy",
                 "--tasks", "2", "--group-size", "2", "--schedulers", "sync,async", "--repeats", "1",
                 "--json", str(report), "-q"]) == 0
    simulated = json.loads(report.read_text())
    assert "fitted:local tiny-llama (linear)" in simulated["engine_description"]
    assert "projection" not in simulated["engine_description"]
    sync, async_ = simulated["policies"]
    assert async_["makespan_s"] < sync["makespan_s"]


@pytest.mark.parametrize("content, message", [
    (None, "does not exist; write one with `rollopt calibrate --engine local --out FILE`"),
    ("{not json", "is not a rollopt cost file (Expecting property name"),
    ('{"format": "other"}', "is not a rollopt-cost/1 cost file; write one with `rollopt calibrate"),
    ('{"format": "rollopt-cost/1", "fitted_to": "x", "coefficients": {"fixed_s": 1}, "engine": {}}',
     "lacks or mangles 'per_prefill_token_s'"),
    ('{"format": "rollopt-cost/1", "fitted_to": "x", "coefficients": {"fixed_s": -1, "per_prefill_token_s": 0, '
     '"per_decode_seq_s": 0, "per_kv_token_s": 0}, "engine": {"max_running": 1, "prefill_chunk": 1, '
     '"block_size": 16, "max_context": 64, "kv_tokens": 64}}', "holds a negative coefficient"),
])
def test_a_bad_cost_file_is_one_line_naming_the_command_that_writes_one(tmp_path, capsys, content, message):
    path = tmp_path / "cost.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SimEngineConfig(cost_file=str(path))
    assert main(["bench", "--engine", "sim", "--engine-option", f"cost_file={path}", "--workload", "tool-heavy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rollopt bench: engine.cost_file") and "rollopt calibrate" in err


def test_a_cost_file_and_coefficients_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="engine.cost_file or engine.linear, not both"):
        SimEngineConfig(cost_file=str(tmp_path / "x.json"), linear=(1, 0, 0, 0), fitted_to="x", kv_tokens=64)


def test_calibrating_the_simulated_engine_itself_is_refused():
    from rollopt.engines.sim_calibration import calibrate_engine

    with pytest.raises(ConfigError, match="virtual clock: calibrate a real engine"):
        anyio.run(calibrate_engine, SimEngineConfig(kv_tokens=4096, max_context=2048))
