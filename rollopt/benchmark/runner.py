"""Run several scheduling policies on one workload, interleaved (A B C, A B C, ...) so machine drift spreads
evenly, on one warm engine whose prefix cache is flushed before every step. Each policy sees the identical
workload: the same tasks, the same per-request sampling seeds."""

from __future__ import annotations

import os
import statistics
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncContextManager, Callable

import anyio
import torch

from rollopt.benchmark.measure import Calibration, calibrate, overlappable_turns, step_metrics
from rollopt.benchmark.workloads import Workload
from rollopt.chat import ChatRenderer
from rollopt.config import LocalEngineConfig
from rollopt.engines import EngineContext, build_engine
from rollopt.engines import engine_config as engine_config_by_name
from rollopt.engines.base import Engine
from rollopt.engines.virtual_clock import start_repeatable_run
from rollopt.executor import RolloutExecutor, episode_specs
from rollopt.modeling import LoadedModel
from rollopt.schedulers import build_scheduler
from rollopt.step import Environment

MEDIAN_KEYS = ("makespan_s", "lower_bound_s", "tokens_generated", "throughput_tok_s", "engine_busy_frac",
               "prefill_tokens", "naive_prefill_tokens", "cached_tokens", "p50_latency_s", "p99_latency_s",
               "returned_trajectories", "preempted", "overlappable_turns", "tool_turn_latency_s")


@dataclass(frozen=True)
class BenchRun:
    workload: Workload
    schedulers: tuple[str, ...]
    repeats: int = 3
    seed: int = 0
    trace_dir: Path | None = None


def engine_config(kind: str, workload: Workload | None = None, **options: Any) -> Any:
    """The bench's configuration of engine ``kind`` for ``workload``: the embedded engine sized for it (one
    OpenMP thread, leaving the second core to the event loop; without a workload, a workload's default running
    limit), or a registered engine's defaults; ``options`` override fields (``rollopt bench --engine-option``)."""
    if kind == "local":
        max_running = workload.max_running if workload is not None else Workload.max_running
        options = {"max_running": max_running, "max_context": 4096, "prefix_cache_tokens": 65536,
                   "kv_budget_mb": 12288, "threads": 1, **options}
    return engine_config_by_name(kind, **options)


async def bench(run: BenchRun, engine: Any = None, model: LoadedModel | None = None,
                on_step: Callable[[str, int], None] = lambda name, rep: None) -> dict[str, Any]:
    """``rollopt bench`` as a function: load the workload's model (unless given), start ``engine`` (a
    configuration, see :func:`engine_config`; default: the embedded engine sized for the workload) and run
    every policy; the report dict (what ``--json`` writes). A user's environment::

        report = await bench(BenchRun(environment_workload(MyEnv()), ("sync", "async"), repeats=1))
    """
    from rollopt.modeling import load_model

    engine = engine or engine_config("local", run.workload)
    model = model or load_model(run.workload.model, seed=run.seed)
    env = run.workload.make_env()
    script = None
    if getattr(engine, "scripted", False) and hasattr(env, "simulated_model"):
        script = env.simulated_model(model.tokenizer)  # the simulated engine writes the agent's turns
    report = await run_policies(run, model, build_engine(engine, model, EngineContext(script=script)), engine.kind,
                                on_step, env)
    if getattr(engine, "scripted", False):  # a scripted engine's costs follow its model shape; the loaded model gives only tokens
        shape = getattr(engine, "model_shape", None)
        report["model"] = f"{shape} (tokenizer: {model.name})" if shape else model.name
    return report


def _engine_counters(engine: Engine) -> dict[str, float]:
    """The engine's busy time and prefill counters; over several servers (``RoutedEngine.engines``) the busy
    time is their mean (so busy / makespan stays a fraction) and the token counts their sum."""
    members = getattr(engine, "engines", [engine])
    stats = [getattr(e, "stats", None) for e in members]
    if not stats or any(s is None or callable(s) for s in stats):
        return {}
    return {"busy_s": sum(s.busy_s for s in stats) / len(stats), "prefill_tokens": sum(s.prefill_tokens for s in stats),
            "cached_tokens": sum(s.cached_tokens for s in stats)}


async def run_policies(run: BenchRun, model: LoadedModel, engine_cm: AsyncContextManager[Engine], engine_kind: str,
                       on_step: Callable[[str, int], None] = lambda name, rep: None,
                       env: Environment | None = None) -> dict[str, Any]:
    """Run every policy ``repeats`` times on the engine ``engine_cm`` starts (on ``env``, default: the
    workload's); return the report dict (see ``rollopt bench --help``)."""
    w = run.workload
    env = env or w.make_env()
    renderer = ChatRenderer(model.tokenizer)
    per_policy: dict[str, list[dict[str, float]]] = {name: [] for name in run.schedulers}
    overlappable: set[tuple[str, int]] | None = None

    def decode(ids: list[int]) -> str:
        return model.tokenizer.decode(ids, skip_special_tokens=True)
    async with AsyncExitStack() as stack:
        engine = await stack.enter_async_context(engine_cm)
        info = await engine.info()
        servers = getattr(engine, "engines", [engine])  # several behind a RoutedEngine: calibrate one, scale
        cal: Calibration = (await calibrate(servers[0], info.vocab_size, w.max_running,
                                            long_context=min(512, info.max_context - 64))).across(len(servers))
        described = getattr(engine, "describe", lambda: "")()  # e.g. the sim's cost model (a projection?)
        for rep in range(run.repeats):
            for name in run.schedulers:
                policy = build_scheduler(name)
                preempts = any(getattr(p, "name", "") == "preempt" for p in getattr(policy, "parts", [policy]))
                n_tasks = w.tasks + (w.extra_groups if preempts else 0)
                specs = episode_specs(env.tasks(n_tasks, run.seed), w.group_size, w.sampling, run.seed, **w.fork)
                await engine.flush_cache()
                await start_repeatable_run(run.seed * 1_000_003 + rep)  # on the virtual clock: repeats exactly
                before = _engine_counters(engine)
                executor = RolloutExecutor(env, engine, renderer, policy, clock=anyio.current_time)
                result = await executor.run(specs, target_groups=w.tasks if preempts else None)
                after = _engine_counters(engine)
                delta = {k: after[k] - before[k] for k in after}
                carried = [r.trajectory for r in executor.carry]
                if overlappable is None:  # the same turns under every policy (R1 tokens): found once
                    overlappable = overlappable_turns(result.trajectories, decode)
                metrics = step_metrics(result, carried, delta, cal, overlappable)
                per_policy[name].append(metrics)
                if run.trace_dir is not None and rep == run.repeats - 1:
                    _write_traces(run.trace_dir, name, result)
                per_policy[name][-1]["_timeline"] = _timeline(result)  # type: ignore[assignment]
                on_step(name, rep)
    return {**_summarize(run, model, engine_kind, cal, per_policy), "engine_description": described}


def save_report(report: dict[str, Any], path: Path) -> Path:
    """Write the report as JSON (without the per-trajectory timelines, which only the plot uses)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    slim = {**report, "policies": [{k: v for k, v in p.items() if k != "timeline"} for p in report["policies"]]}
    path.write_text(json.dumps(slim, indent=2))
    return path


def _write_traces(trace_dir: Path, name: str, result) -> None:
    import json

    trace_dir.mkdir(parents=True, exist_ok=True)
    safe = name.replace("+", "_")
    (trace_dir / f"{safe}.trace.json").write_text(json.dumps(result.graph.chrome_trace()))
    result.graph.save(trace_dir / f"{safe}.graph.json")


def _timeline(result) -> list[tuple[str, str, float, float]]:
    return [(d["trajectory"], d["kind"], d["start"], d["end"]) for _, d in result.graph.g.nodes(data=True)
            if d["kind"] in ("generate", "tool", "prefill") and d["start"] is not None and d["end"] is not None]


def _summarize(run: BenchRun, model: LoadedModel, engine_kind: str, cal: Calibration, per_policy) -> dict[str, Any]:
    baseline = "sync" if "sync" in per_policy else run.schedulers[0]
    policies = []
    for name, steps in per_policy.items():
        med = {k: statistics.median(s[k] for s in steps) for k in MEDIAN_KEYS}
        ratios = [b["makespan_s"] / s["makespan_s"] for b, s in zip(per_policy[baseline], steps)]
        policy = build_scheduler(name)
        policies.append({
            "scheduler": name,
            "risk_class": policy.risk_class.value,
            **({"without_early_tools": "+".join(p.name for p in getattr(policy, "parts", [policy])
                                                 if not p.early_tool_start) or "async"}
               if policy.early_tool_start else {}),
            **med,
            "makespan_min_s": min(s["makespan_s"] for s in steps),
            "makespan_max_s": max(s["makespan_s"] for s in steps),
            "speedup_vs_sync" if baseline == "sync" else "speedup_vs_baseline": statistics.median(ratios),
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            **({"speedup_vs_async": statistics.median(a["makespan_s"] / s["makespan_s"]
                                                      for a, s in zip(per_policy["async"], steps))}
               if "async" in per_policy and baseline != "async" else {}),
            "efficiency": med["lower_bound_s"] / med["makespan_s"],
            "lost_tokens": max(s["lost_tokens"] for s in steps),
            "repeats": len(steps),
            "timeline": steps[-1]["_timeline"],
        })
    return {
        "workload": run.workload.name,
        "workload_description": run.workload.description,
        "engine": engine_kind,
        "model": model.name,
        "seed": run.seed,
        "baseline": baseline,
        "machine": {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "calibration": cal.__dict__,
        "policies": policies,
    }
