"""`rollopt bench` end to end on a small workload, and the trace it writes."""

import json

from trace_checks import check_trace

from rollopt.cli import main

REQUIRED = {"scheduler", "makespan_s", "speedup_vs_sync", "lower_bound_s", "efficiency", "tokens_generated",
            "throughput_tok_s", "engine_busy_frac", "prefill_tokens", "naive_prefill_tokens", "cached_tokens",
            "p50_latency_s", "p99_latency_s", "lost_tokens", "repeats", "risk_class"}


def test_bench_reports_every_policy_and_writes_json_png_trace(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--workload", "long-tail", "--tasks", "3", "--group-size", "2", "--repeats", "2",
                 "--schedulers", "sync,overlap+prefix,overlap+prefix+preempt", "--json", str(out),
                 "--plot", str(tmp_path / "bench.png"), "--trace", str(tmp_path / "trace")]) == 0
    assert "speedup" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert {"workload", "engine", "model", "seed", "machine"} <= set(report)
    assert [p["scheduler"] for p in report["policies"]] == ["sync", "overlap+prefix", "overlap+prefix+preempt"]
    for p in report["policies"]:
        assert REQUIRED <= set(p)
        assert p["lost_tokens"] == 0 and p["repeats"] == 2
        assert 0 < p["lower_bound_s"] and 0 < p["efficiency"]
        assert p["prefill_tokens"] <= p["naive_prefill_tokens"]
    sync, prefix, preempt = report["policies"]
    assert sync["speedup_vs_sync"] == 1.0
    # same seeded workload: the non-preempting policies generated exactly the same tokens
    assert sync["tokens_generated"] == prefix["tokens_generated"]
    assert preempt["returned_trajectories"] == sync["returned_trajectories"] == 6
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_bench_trace_is_well_formed_and_nested(tmp_path):
    assert main(["bench", "--workload", "branching", "--tasks", "2", "--repeats", "1",
                 "--schedulers", "sync,overlap+prefix", "--trace", str(tmp_path), "--json", str(tmp_path / "b.json")]) == 0
    report = json.loads((tmp_path / "b.json").read_text())
    assert [p["lost_tokens"] for p in report["policies"]] == [0, 0]  # forks share, not duplicate, their tokens
    for name in ("sync", "overlap_prefix"):
        graph = json.loads((tmp_path / f"{name}.graph.json").read_text())
        assert all(n["end"] is not None for n in graph["nodes"])  # every dispatched step finished
        by_traj = check_trace(json.loads((tmp_path / f"{name}.trace.json").read_text()))
        assert set(by_traj) == {n["trajectory"] for n in graph["nodes"]} and len(by_traj) == 8  # 2 trees × 4
        for traj, events in by_traj.items():  # every trajectory decoded and called tools (the workload plans them)
            assert events["generate"] and events["prefill"] and events["decode"] and events["tool call"], traj
            assert len(events["generate"]) == sum(n["kind"] == "generate" and n["trajectory"] == traj
                                                  for n in graph["nodes"])
            assert {e["name"] for e in events["trajectory"]} == {"trajectory"}
            assert events["reward"] and events["trajectory"][0]["args"]["status"] == "completed"


def test_lower_bound_takes_the_largest_of_decode_prefill_and_critical_path_not_their_sum():
    """Decode (1,000 generated tokens at 100 tok/s = 10 s) and unique prefill (1,000 prompt tokens at 100 tok/s
    = 10 s) each bound the step alone; an engine that mixes prefill chunks into decode steps overlaps them, so
    their sum (20 s) is no bound. The bound is 10 s: no trajectory's own path is longer (ten each, 1 s)."""
    from rollopt.benchmark.measure import Calibration, lower_bound_s
    from rollopt.trajectory import TokenSpan, Trajectory

    cal = Calibration(step_s=0.001, peak_decode_tok_s=100.0, prefill_tok_s=100.0)
    trajs = []
    for i in range(10):
        traj = Trajectory.start(f"t{i}", f"task{i}", f"g{i}", [1000 * i + k for k in range(100)])
        traj.append(TokenSpan.generated([7] * 100, [0.0] * 100, [0] * 100))
        trajs.append(traj)
    assert lower_bound_s(trajs, cal) == 10.0


def test_the_bound_over_several_servers_adds_their_throughput():
    """Eight servers prefill and decode in parallel: the work terms shrink eightfold, a trajectory's own critical
    path (it runs on one server) does not."""
    from rollopt.benchmark.measure import Calibration, critical_path_s, lower_bound_s
    from rollopt.trajectory import TokenSpan, Trajectory

    one = Calibration(step_s=0.001, peak_decode_tok_s=100.0, prefill_tok_s=100.0, per_kv_token_s=1e-4)
    eight = one.across(8)
    trajs = []
    for i in range(80):
        traj = Trajectory.start(f"t{i}", f"task{i}", f"g{i}", [1000 * i + k for k in range(100)])
        traj.append(TokenSpan.generated([7] * 10, [0.0] * 10, [0] * 10))
        trajs.append(traj)
    assert lower_bound_s(trajs, one) == 80.0  # 8,000 unique prompt tokens at 100/s
    assert lower_bound_s(trajs, eight) == 10.0
    long = Trajectory.start("long", "task-long", "g-long", list(range(5000, 5500)))  # 500 prompt tokens
    long.append(TokenSpan.generated([7] * 1000, [0.0] * 1000, [0] * 1000))
    path = critical_path_s(long, eight)
    assert path == critical_path_s(long, one) and path > 5.0  # its prompt alone: 500 tokens at one server's 100/s
    assert lower_bound_s(trajs + [long], eight) == path


def test_the_kv_capacity_term_tightens_the_bound_and_no_schedule_beats_it():
    """On a KV-bound simulated engine (64 agents whose histories exceed the pool) each iteration can attend to
    at most the pool, so the step needs attended / pool iterations at a lone step's cost each: a tighter bound
    than full running batches give. It must still be a bound: below every policy's makespan."""
    from dataclasses import replace

    import anyio
    import trio.testing

    from rollopt import ChatRenderer, RolloutExecutor, SamplingParams, episode_specs
    from rollopt.benchmark.measure import calibrate, lower_bound_s
    from rollopt.config import SimEngineConfig
    from rollopt.engines.sim import SimEngine
    from rollopt.engines.sim_cost import model_shape
    from rollopt.environments.agentic import AgentEnv
    from rollopt.modeling.tiny import build_tokenizer
    from rollopt.schedulers import build_scheduler

    tokenizer = build_tokenizer()
    env = AgentEnv("swe-agent", token_scale=0.4, latency_scale=0.02)  # short tools: the engine binds
    config = SimEngineConfig(model_shape="llama-3.1-8b", kv_tokens=40_000, max_context=16384)

    async def main():
        engine = SimEngine.from_config(config, model_shape("llama-3.1-8b"), vocab_size=len(tokenizer),
                                       eos_token_ids=(tokenizer.eos_token_id,), tokenizer=tokenizer,
                                       script=env.simulated_model(tokenizer))
        async with engine:
            cal = await calibrate(engine, len(tokenizer), 256)
            out = {}
            for name in ("async", "kv"):
                await engine.flush_cache()
                specs = episode_specs(env.tasks(8, 0), 8, SamplingParams(temperature=1.0), 0)
                executor = RolloutExecutor(env, engine, ChatRenderer(tokenizer), build_scheduler(name),
                                           clock=anyio.current_time)
                result = await executor.run(specs)
                out[name] = (result.wall_s, lower_bound_s(result.trajectories, cal),
                             lower_bound_s(result.trajectories, replace(cal, iteration_kv_tokens=None)))
            return cal, out

    cal, out = anyio.run(main, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})
    assert cal.iteration_kv_tokens == 40_000 and 0 < cal.iteration_s <= 1.01 * cal.step_s
    for name, (makespan, bound, without) in out.items():
        assert without < bound <= makespan, (name, makespan, bound, without)
