"""What ``rollopt bench`` measures, and the lower bound it compares against.

Engine calibration (wall clock, on the engine under test, after warm-up):

* ``step_s``: seconds per decode step of one request alone;
* ``peak_decode_tok_s``: decode tokens/s with ``max_running`` requests at once;
* ``prefill_tok_s``: prompt tokens/s of one long cold prefill;
* ``per_kv_token_s``: what one decode step spends per context token it attends to — the decode time of a few
  requests with long prompts minus that with short ones, per extra context token (0 where the difference is
  within noise). At hundreds of agents with 10k+-token histories a GPU's decode is bound by these KV reads, not by
  the weights, and a bound calibrated at short contexts alone would be far below what any schedule can reach.

Lower bound of one rollout step, from the work it actually did (its trajectories, returned or carried over):

    lower_bound_s = max(max(decode_tokens / (peak_decode_tok_s · n), attended_tokens · per_kv_token_s / n,
                            (attended_tokens / pool · iteration_s + attended_tokens · per_kv_token_s) / n),
                        unique_prefill_tokens / (prefill_tok_s · n),
                        max over trajectories of its own critical path)

on ``n`` identical servers (one calibrated; ``Calibration.servers``), where ``attended_tokens`` sums, over every
generated token, the context it attends to (its position). A decode
step takes at least the longer of its weight/compute time and its KV-read time, so the larger of the two
decode terms is a bound (their sum would not be, on a compute-bound step). Decode and prefill are not added
either: an engine that mixes prefill chunks into memory-bound decode steps (SGLang, the simulated engine) hides
prefill compute under the KV reads — on the simulated search agent the sum exceeded the measured makespan (LB
44.0 s, makespan 43.4 s), so it was no bound.

The third decode term is the engine's KV capacity: an iteration attends to at most the ``pool`` its running
requests' KV lives in (``EngineInfo.running_kv_tokens``; engines that do not report one get no such term), so
the step needs at least ``attended_tokens / pool`` iterations, and each costs at least a lone request's
``iteration_s`` (the weights are read, the step launched) besides its KV reads — both are memory traffic, so they
add even where the step is compute-bound. Without it the bound assumed decode batches as large as the running
limit, which a KV-bound engine cannot form: on the simulated software-engineering agent (1,024 histories to 32k
on one H200) the bound was 1,052 s under ``auto``'s 1,497 s step, and is 1,220 s with it (both measured).

where ``unique_prefill_tokens`` counts each distinct non-generated prefix token once (a trie over all
trajectories: shared prompts and fork points count once) and a trajectory's critical path is its generated
tokens × ``step_s`` + its attended tokens × ``per_kv_token_s`` + its own unique prompt tokens / ``prefill_tok_s`` + per turn the longest of its tool calls
(parallel calls overlap), at one server's rates (a trajectory runs on one server). No schedule can beat any term
on this engine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import anyio
import numpy as np

from rollopt.engines.base import Engine, GenerateRequest, SamplingParams
from rollopt.executor import RolloutResult
from rollopt.toolcalls import CLOSE_TAG
from rollopt.trajectory import TokenKind, Trajectory


@dataclass(frozen=True)
class Calibration:
    """One server's rates (above), and how many identical ``servers`` share the work (``RoutedEngine``)."""

    step_s: float
    peak_decode_tok_s: float
    prefill_tok_s: float
    per_kv_token_s: float = 0.0
    servers: int = 1
    iteration_s: float = 0.0
    """What one decode iteration costs at least, apart from its KV reads: a lone request's step, per token between
    a short and a long request (so the per-request path is not in it); 0: not measured."""
    iteration_kv_tokens: int | None = None
    """The most context one iteration can attend to (``EngineInfo.running_kv_tokens``, the pool the running
    requests' KV lives in); None: not reported, and the bound has no KV-capacity term."""

    def across(self, servers: int) -> "Calibration":
        """This server's calibration for ``servers`` identical ones working in parallel: in the bound their
        decode and prefill throughputs add and their KV reads split, while a trajectory's own critical path runs
        on one server at its rates. With one server's rates for the work terms, the bound counted 8 servers'
        prefill at one server's rate: on the simulated search agent at 4,100 on 8 servers it (89.6 s) was 3.3×
        the makespan."""
        return replace(self, servers=servers)


async def calibrate(engine: Engine, vocab_size: int, max_running: int, tokens: int = 48,
                    long_context: int = 512) -> Calibration:
    rng = np.random.default_rng(0)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(int(x) for x in rng.integers(3, vocab_size, n))

    sampling = SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True)
    await engine.generate(GenerateRequest("cal.warm", ids(16), sampling))
    started = anyio.current_time()
    await engine.generate(GenerateRequest("cal.one", ids(16), sampling))
    step_s = (anyio.current_time() - started) / tokens
    short = max(1, tokens // 6)
    started = anyio.current_time()
    await engine.generate(GenerateRequest("cal.short", ids(16), replace(sampling, max_new_tokens=short)))
    iteration_s = max(0.0, step_s * tokens - (anyio.current_time() - started)) / (tokens - short)
    pool = (await engine.info()).running_kv_tokens
    started = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for i in range(max_running):
            tg.start_soon(engine.generate, GenerateRequest(f"cal.b{i}", ids(16), sampling))
    peak = max_running * tokens / (anyio.current_time() - started)
    long_prompt = ids(384)
    started = anyio.current_time()
    await engine.generate(GenerateRequest("cal.prefill", long_prompt, SamplingParams(max_new_tokens=1, temperature=0)))
    prefill = len(long_prompt) / (anyio.current_time() - started)
    if long_context <= 16:  # the engine's context leaves no room to measure it
        await engine.flush_cache()
        return Calibration(step_s, peak, prefill, iteration_s=iteration_s, iteration_kv_tokens=pool)
    extra = (await _decode_s(engine, ids, long_context, tokens) - await _decode_s(engine, ids, 16, tokens))
    per_kv = max(0.0, extra / ((tokens - 1) * _KV_PROBES * (long_context - 16)))
    await engine.flush_cache()
    return Calibration(step_s, peak, prefill, per_kv, iteration_s=iteration_s, iteration_kv_tokens=pool)


_KV_PROBES = 8  # requests decoding at once while the KV-read cost is measured (few: the step stays memory-bound)


async def _decode_s(engine: Engine, ids: Callable[[int], tuple[int, ...]], prompt_tokens: int, tokens: int) -> float:
    """Seconds ``_KV_PROBES`` requests with ``prompt_tokens``-token prompts spend decoding ``tokens - 1`` tokens:
    the time of prefill + ``tokens`` minus the time of the same prefills + 1 (cold, the cache flushed)."""

    async def batch(prompts: list[tuple[int, ...]], n: int) -> float:
        await engine.flush_cache()
        sampling = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            for i, prompt in enumerate(prompts):
                tg.start_soon(engine.generate, GenerateRequest(f"cal.kv{prompt_tokens}.{n}.{i}", prompt, sampling))
        return anyio.current_time() - started

    prompts = [ids(prompt_tokens) for _ in range(_KV_PROBES)]
    return await batch(prompts, tokens) - await batch(prompts, 1)


def unique_prefill_tokens(trajectories: Sequence[Trajectory]) -> int:
    """Distinct non-generated prefix positions over all trajectories (a trie, by chained hashes): a prompt
    or fork point that several trajectories share counts once."""
    seen: set[int] = set()
    for traj in trajectories:
        h = 0
        for token, kind in zip(traj.token_ids.tolist(), traj.kinds.tolist()):
            h = hash((h, token))
            if kind != TokenKind.GENERATED:
                seen.add(h)
    return len(seen)


def sampled_tokens(trajectories: Sequence[Trajectory]) -> int:
    """Generated tokens held, counting the tokens a fork's clone copied from its parent once."""
    total = sum(t.num_generated for t in trajectories)
    return total - sum(int(t.loss_mask[: t.metadata["cloned_at"]].sum()) for t in trajectories
                       if "cloned_at" in t.metadata)


def critical_path_s(traj: Trajectory, cal: Calibration) -> float:
    tool_s = sum(max((r.latency_s for r in turn.tool_results), default=0.0) for turn in traj.turns)
    kv_s = attended_tokens([traj]) * cal.per_kv_token_s  # a lone request's step is memory-bound: additive
    return traj.num_generated * cal.step_s + kv_s + traj.prompt_length / cal.prefill_tok_s + tool_s


def attended_tokens(trajectories: Sequence[Trajectory]) -> int:
    """Context positions attended to by the generated tokens: the sum of every generated token's position."""
    return sum(int(np.flatnonzero(t.kinds == TokenKind.GENERATED).sum()) for t in trajectories)


def lower_bound_s(trajectories: Sequence[Trajectory], cal: Calibration) -> float:
    if not trajectories:
        return 0.0
    n = cal.servers
    sampled, attended = sampled_tokens(trajectories), attended_tokens(trajectories)
    decode_s = max(sampled / (cal.peak_decode_tok_s * n), attended * cal.per_kv_token_s / n)
    if cal.iteration_kv_tokens:  # each iteration attends to at most the pool: at least attended / pool iterations
        iterations = attended / cal.iteration_kv_tokens
        decode_s = max(decode_s, (iterations * cal.iteration_s + attended * cal.per_kv_token_s) / n)
    prefill_s = unique_prefill_tokens(trajectories) / (cal.prefill_tok_s * n)
    return max(decode_s, prefill_s, max(critical_path_s(t, cal) for t in trajectories))


def overlappable_turns(trajectories: Sequence[Trajectory], decode: Callable[[list[int]], str]) -> set[tuple[str, int]]:
    """``(trajectory id, turn)`` of the turns whose tools can start while the turn still decodes: the model wrote
    its calls into the text (not planned after the turn), and wrote several, or text after the last one. The same
    set under every policy of one workload (R1: the tokens are the same), so their latencies compare."""
    found = set()
    for traj in trajectories:
        for turn in traj.turns:
            if not turn.tool_calls:
                continue
            text = decode(traj.token_ids[turn.gen_start:turn.gen_end].tolist())
            closed = text.count(CLOSE_TAG)
            if closed >= 2 or (closed == 1 and text.rsplit(CLOSE_TAG, 1)[1].strip()):
                found.add((traj.id, turn.index))
    return found


def tool_turn_latency_s(result: RolloutResult, turns: set[tuple[str, int]]) -> float:
    """Mean seconds from each of ``turns``' first request to the end of its last tool call (NaN: none): what
    starting a turn's tools inside it (``overlap``) shortens, apart from everything else a policy changes."""
    started: dict[tuple[str, int], float] = {}
    for _, d in result.graph.nodes("generate"):
        key = (d["trajectory"], d["turn"])
        if key in turns and d["start"] is not None:
            started[key] = min(started.get(key, math.inf), d["start"])
    ended: dict[tuple[str, int], float] = {}
    for _, d in result.graph.nodes("tool"):
        match = _CALL_TURN.search(d.get("call", ""))
        key = (d["trajectory"], int(match.group(1))) if match else None
        if key in started and d["end"] is not None:
            ended[key] = max(ended.get(key, 0.0), d["end"])
    spans = [ended[k] - started[k] for k in ended]
    return float(np.mean(spans)) if spans else float("nan")


_CALL_TURN = re.compile(r"(?:^|\.)t(\d+)\.c\d+$")  # a call id names its turn: "<trajectory>.t3.c0", "plan.t3.c0"


def step_metrics(result: RolloutResult, carried: Sequence[Trajectory], engine_delta: dict[str, float],
                 cal: Calibration, overlappable: set[tuple[str, int]] | None = None) -> dict[str, float]:
    """Metrics of one rollout step; ``engine_delta`` holds the engine counters' change over the step;
    ``overlappable``: the turns whose latency ``tool_turn_latency_s`` reports (:func:`overlappable_turns`)."""
    everything = list(result.trajectories) + list(carried)
    ends = {d["trajectory"]: d["end"] for _, d in result.graph.nodes("reward")}
    latencies = [ends[t.id] for t in result.trajectories if t.id in ends]
    requests = [d for _, d in result.graph.nodes("generate")] + [d for _, d in result.graph.nodes("prefill")]
    naive = sum(d.get("prompt_tokens", 0) for d in requests if d["kind"] == "generate")
    # engines without counters (SGLang): computed prefill = what the requests sent minus what the cache served
    reported_cached = sum(d.get("cached_tokens", 0) or 0 for d in requests)
    reported_prefill = naive + sum(d.get("tokens", 0) for d in requests if d["kind"] == "prefill") - reported_cached
    makespan = result.wall_s
    held = sampled_tokens(everything)
    return {
        "makespan_s": makespan,
        "lower_bound_s": lower_bound_s(everything, cal),
        "tokens_generated": result.tokens_streamed,
        "throughput_tok_s": result.tokens_streamed / makespan if makespan else 0.0,
        "engine_busy_frac": engine_delta.get("busy_s", float("nan")) / makespan if makespan else float("nan"),
        "prefill_tokens": engine_delta.get("prefill_tokens", reported_prefill),
        "naive_prefill_tokens": naive,
        "cached_tokens": engine_delta.get("cached_tokens", reported_cached),
        "p50_latency_s": float(np.percentile(latencies, 50)) if latencies else float("nan"),
        "p99_latency_s": float(np.percentile(latencies, 99)) if latencies else float("nan"),
        "lost_tokens": result.tokens_streamed - held,
        "returned_trajectories": len(result.trajectories),
        "preempted": result.preempted,
        "overlappable_turns": len(overlappable or ()),
        "tool_turn_latency_s": tool_turn_latency_s(result, overlappable) if overlappable else float("nan"),
    }
