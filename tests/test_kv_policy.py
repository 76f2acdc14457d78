"""The ``kv`` policy: its decisions on hand-built views (no engine, no clock), the online tool latencies it
reads, and, on the simulated engine (virtual clock), that it changes when requests start and what stays
cached, never a token, and that under KV pressure it removes the recompute ``async`` pays."""

from __future__ import annotations

import anyio
import pytest
import trio.testing

from rollopt import ChatRenderer, RolloutExecutor, SamplingParams, episode_specs
from rollopt.config import SimEngineConfig
from rollopt.engines.routed import RoutedEngine
from rollopt.engines.sim import SimEngine
from rollopt.engines.sim_cost import model_shape
from rollopt.engines.virtual_clock import start_repeatable_run
from rollopt.environments.agentic import AgentEnv
from rollopt.modeling.tiny import build_tokenizer
from rollopt.schedulers import KVPolicy, RolloutView, Stage, ToolLatencies, TrajectoryView, build_scheduler

KV = 10_000


def entry(tid: str, stage: Stage, context: int, turn: int = 1, tool: str | None = None) -> TrajectoryView:
    return TrajectoryView(tid, "g", turn, stage, 0, context_tokens=context, last_tool=tool)


def view(*entries: TrajectoryView, kv: int | None = KV, latencies: ToolLatencies | None = None) -> RolloutView:
    return RolloutView(tuple(entries), kv_tokens=kv, tool_latency=latencies)


def busy(n: int, context: int) -> list[TrajectoryView]:
    """``n`` started trajectories decoding, ``context`` tokens each."""
    return [entry(f"b{i}", Stage.GENERATE, context) for i in range(n)]


def test_admission_holds_a_new_trajectory_while_the_kv_in_use_and_its_prompt_exceed_the_pool():
    policy = KVPolicy(min_decoding=0, fill=0.8)
    new = entry("n", Stage.GATE, 1_000, turn=0)
    assert not new.started
    assert not policy.may_generate(view(*busy(4, 1_800), new), "n")  # 7,200 + 1,000 > 8,000
    assert policy.may_generate(view(*busy(4, 1_700), new), "n")  # 6,800 + 1,000 fits
    assert policy.may_generate(view(*busy(4, 1_800), new, kv=None), "n")  # no KV size reported: async
    assert policy.may_generate(view(entry("d", Stage.DONE, 50_000), new), "n")  # nothing in the engine: go
    started = entry("s", Stage.GATE, 1_000, turn=2)
    assert policy.may_generate(view(*busy(4, 1_800), started), "s")  # admitted work is never held back
    assert policy.priority(view(started, new), "s") > policy.priority(view(started, new), "n")


def test_the_kv_in_use_counts_decoding_and_tool_waiting_histories_only():
    """A history whose tool runs is in use (its next turn wants it back); one done, preempted or held at its gate
    is not."""
    policy = KVPolicy(min_decoding=0, fill=1.0, idle_fill=0.0)
    new = entry("n", Stage.GATE, 1_000, turn=0)
    tools = [entry(f"t{i}", Stage.TOOLS, 2_100) for i in range(4)]
    assert view(*busy(1, 1_000), *tools).active_tokens == 9_400
    assert not policy.may_generate(view(*busy(1, 1_000), *tools, new), "n")  # 9,400 + 1,000 > 10,000
    idle = [entry("d", Stage.DONE, 9_000), entry("p", Stage.PREEMPTED, 9_000), entry("g", Stage.GATE, 9_000)]
    assert view(*busy(1, 1_000), *idle).active_tokens == 1_000
    assert policy.may_generate(view(*busy(1, 1_000), *idle, new), "n")


def test_while_the_kv_decoding_now_leaves_the_pool_half_free_a_new_trajectory_goes_whatever_waits_on_tools():
    """Histories waiting on tools fill the pool, but little is decoding: holding the newcomer back would leave the
    engine idle, while admitting it costs at most the recompute of a history it evicts."""
    new = entry("n", Stage.GATE, 1_000, turn=0)
    tools = [entry(f"t{i}", Stage.TOOLS, 2_000) for i in range(5)]
    assert view(*busy(2, 1_500), *tools).generating_tokens == 3_000
    assert view(*busy(2, 1_500), *tools).active_tokens == 13_000
    assert KVPolicy(min_decoding=0).may_generate(view(*busy(2, 1_500), *tools, new), "n")  # 3,000 + 1,000 <= 5,000
    assert not KVPolicy(min_decoding=0).may_generate(view(*busy(3, 1_500), *tools, new), "n")  # 4,500 + 1,000 > 5,000
    assert not KVPolicy(min_decoding=0, idle_fill=0.0).may_generate(view(*busy(2, 1_500), *tools, new), "n")
    assert KVPolicy(min_decoding=0, idle_fill=1.0).may_generate(view(*busy(5, 1_500), *tools, new), "n")  # 8,500 fits
    with pytest.raises(ValueError, match="idle_fill"):
        KVPolicy(fill=0.5, idle_fill=0.8)


def test_while_fewer_than_min_decoding_requests_decode_in_a_pool_too_small_for_that_many_a_new_one_goes():
    """Where the pool cannot hold ``min_decoding`` histories of the size decoding now, holding programs back keeps
    the decode batch at a few rows, whose iterations cost more than the recompute saved (the real SGLang CPU server
    under KV pressure: ``kv`` 0.97× of ``async`` without this floor). Where it can, a small batch means programs
    are in their tools and the KV rule decides; behind a router, where each pool is sized alone, no floor."""
    new = entry("n", Stage.GATE, 1_000, turn=0)
    tools = [entry(f"t{i}", Stage.TOOLS, 2_000) for i in range(5)]
    small_pool = view(*busy(15, 700), *tools, new)  # 16 histories of 700 > 10,000: the pool cannot hold them
    assert small_pool.generating == 15 and small_pool.active_tokens + 1_000 > KV
    assert KVPolicy(idle_fill=0.0).may_generate(small_pool, "n")  # 15 rows < 16: admitted
    assert not KVPolicy(idle_fill=0.0, min_decoding=15).may_generate(small_pool, "n")
    assert not KVPolicy(idle_fill=0.0).may_generate(view(*busy(16, 700), *tools, new), "n")  # 16 rows decode
    roomy = view(*busy(15, 100), *tools, new)  # 16 × 100 fits: programs are in their tools, the KV rule decides
    assert roomy.active_tokens + 1_000 > KV and not KVPolicy(idle_fill=0.0).may_generate(roomy, "n")
    pooled = RolloutView(small_pool.trajectories, kv_tokens=KV, kv_pools=8)  # the pools summed
    assert not KVPolicy(idle_fill=0.0, place=False).may_generate(pooled, "n")


def test_pins_last_the_learned_latency_of_the_tool_just_called_and_never_under_pressure():
    latencies = ToolLatencies()
    for seconds in (1.0, 2.0, 3.0, 4.0, 100.0):
        latencies.record("bash", seconds)
    latencies.record("edit", 0.5)
    policy = KVPolicy(min_decoding=0, quantile=0.5, margin=2.0, prior_s=5.0, max_pin_s=60.0)
    calm = [entry("a", Stage.GENERATE, 1_000, tool="edit"), entry("b", Stage.GENERATE, 1_000, tool="bash"),
            entry("c", Stage.GENERATE, 1_000), entry("d", Stage.GENERATE, 1_000, tool="grep")]
    v = view(*calm, latencies=latencies)
    assert policy.keep_warm(v, "a") == pytest.approx(1.0)  # median of edit's one latency x 2
    assert policy.keep_warm(v, "b") == pytest.approx(6.0)  # median of bash's five x 2
    assert policy.keep_warm(v, "c") == pytest.approx(latencies.quantile(0.5) * 2)  # no tool yet: all tools'
    assert policy.keep_warm(view(*calm), "c") == pytest.approx(10.0)  # nothing learned: the prior x 2
    assert KVPolicy(min_decoding=0, quantile=1.0).keep_warm(v, "b") == 0.0  # 125 s > max_pin_s: let it go, recompute
    pressed = view(*busy(11, 1_000), latencies=latencies)  # 11,000 > 10,000: pins would crowd out
    assert policy.keep_warm(pressed, "b0") == 0.0
    assert policy.keep_warm(view(*calm, kv=None, latencies=latencies), "b") == 0.0


def test_tool_latencies_keep_a_window_per_tool():
    latencies = ToolLatencies(window=3)
    for seconds in (10.0, 1.0, 2.0, 3.0):
        latencies.record("bash", seconds)
    assert latencies.count("bash") == 3 and latencies.count("edit") == 0
    assert latencies.quantile(1.0, "bash") == 3.0  # the 10 s fell out of the window
    assert latencies.quantile(0.5, "edit") is None


@pytest.mark.parametrize("kwargs", [{"fill": 0}, {"fill": 2.5}, {"quantile": 0},
                                    {"margin": 0}, {"max_pin_s": -1}, {"min_decoding": -1}])
def test_bad_options_are_refused(kwargs):
    with pytest.raises(ValueError):
        KVPolicy(**kwargs)


# ---------------------------------------------------------------------------------------------- simulated engine
def rollout_on_sim(policy, kv_tokens: int, tasks: int, token_scale: float, servers: int = 1):
    """``tasks`` software-engineering agent groups (8 each) on one simulated H200 (llama-3.1-8b roofline), or on
    ``servers`` of them behind the router (``kv_tokens`` each), trio's task order seeded (the run is the same
    whatever ran before it in the process); the result and the prefill summed over servers."""
    tokenizer = build_tokenizer()
    env = AgentEnv("swe-agent", token_scale=token_scale, latency_scale=0.5)
    config = SimEngineConfig(model_shape="llama-3.1-8b", kv_tokens=kv_tokens, max_context=16384)

    async def main():
        sims = [SimEngine.from_config(config, model_shape("llama-3.1-8b"), vocab_size=len(tokenizer),
                                      eos_token_ids=(tokenizer.eos_token_id,), tokenizer=tokenizer,
                                      script=env.simulated_model(tokenizer)) for _ in range(servers)]
        async with sims[0] if servers == 1 else RoutedEngine(sims, names=[f"s{i}" for i in range(servers)]) as engine:
            specs = episode_specs(env.tasks(tasks, 0), 8, SamplingParams(temperature=1.0), 0)
            await start_repeatable_run(0)
            executor = RolloutExecutor(env, engine, ChatRenderer(tokenizer), policy,
                                       clock=anyio.current_time)
            result = await executor.run(specs)
            return result, sum(sim.stats.prefill_tokens for sim in sims)

    return anyio.run(main, backend="trio", backend_options={"clock": trio.testing.MockClock(autojump_threshold=0)})


def tokens_by_trajectory(result) -> dict[str, tuple[int, ...]]:
    return {t.id: tuple(t.token_ids) for t in result.trajectories}


def test_kv_changes_no_token_and_under_kv_pressure_cuts_recompute_and_makespan():
    """256 agents whose histories (~5k tokens each at this scale) exceed a 200k-token KV several times over.
    (Measured, task-order seeds 0, 1, 2: kv 242.5, 244.2, 244.2 virtual s, prefill 3.98M, 3.20M, 3.20M; async
    256.6 s, 7.24M each. Without ``idle_fill``, admitting only while the KV in use fits: 246.8 s, 1.33M — less
    recompute, but the engine less full.)"""
    policies = (build_scheduler("kv"), build_scheduler("async"))
    (fast, fast_prefill), (slow, slow_prefill) = (rollout_on_sim(p, 200_000, 32, 0.4) for p in policies)
    assert tokens_by_trajectory(fast) == tokens_by_trajectory(slow)  # R1: identical tokens, every trajectory
    assert len(fast.trajectories) == 256 and not any(t.error for t in fast.trajectories)
    assert fast_prefill < 0.6 * slow_prefill  # 0.44-0.55 over the seeds measured
    assert fast.wall_s < slow.wall_s  # virtual seconds


def test_first_waiting_follows_batch_order_as_trajectories_start():
    entries = (entry("a", Stage.GENERATE, 10), entry("b", Stage.GATE, 10, turn=0), entry("c", Stage.GATE, 10, turn=0))
    v = view(*entries)
    assert v.first_waiting == "b"
    v = v.with_entry(entry("c", Stage.GENERATE, 10, turn=0), 1.0)
    assert v.first_waiting == "b"
    v = v.with_entry(entry("b", Stage.GENERATE, 10, turn=0), 2.0)
    assert v.first_waiting is None and v.generating == 3
    assert not KVPolicy(min_decoding=0).may_generate(view(*busy(2, 100), *entries[1:]), "c")  # b is first in line


def test_a_change_before_the_first_waiting_trajectory_scans_nothing(monkeypatch):
    """A started trajectory's turn (before the first waiting one in batch order) cannot make anything earlier
    wait: the snapshot must not rescan the started prefix, or every change costs O(trajectories started)
    (measured: the scan was the scheduler's costliest function at 512 simulated agents)."""
    import rollopt.schedulers.base as base

    scans: list[int] = []

    def counted(entries, start):
        found = first_waiting(entries, start)
        scans.append(found - start)
        return found

    first_waiting = base._first_waiting
    started = [entry(f"s{i}", Stage.GENERATE, 10) for i in range(500)]
    v = view(*started, entry("w", Stage.GATE, 10, turn=0), entry("x", Stage.GATE, 10, turn=0))
    assert v.first_waiting == "w"
    monkeypatch.setattr(base, "_first_waiting", counted)
    for i in range(0, 500, 7):
        v = v.with_entry(entry(f"s{i}", Stage.TOOLS, 10), float(i))
    assert sum(scans) == 0 and v.first_waiting == "w"
    v = v.with_entry(entry("w", Stage.GENERATE, 10, turn=0), 600.0)
    assert v.first_waiting == "x" and sum(scans) == 1  # the one that started: scan on from it


def test_a_change_copies_one_chunk_of_entries_not_all_of_them():
    """At 4,096 trajectories a flat tuple of entries made each state change copy 4,096 references; the next
    snapshot must share every chunk but the changed one with the last (and still read as the full tuple)."""
    from rollopt.schedulers.base import Entries

    before = view(*(entry(f"t{i}", Stage.GENERATE, 10) for i in range(4096)))
    after = before.with_entry(entry("t100", Stage.TOOLS, 10), 1.0)
    old, new = before.trajectories._chunks, after.trajectories._chunks
    assert isinstance(after.trajectories, Entries) and len(new) == 4096 // Entries.CHUNK
    assert [a is b for a, b in zip(old, new)].count(False) == 1
    assert after["t100"].stage is Stage.TOOLS and before["t100"].stage is Stage.GENERATE
    assert after.trajectories[:101][-1] is after["t100"] and len(after.trajectories) == 4096


class CountingKV(KVPolicy):
    """``kv`` that counts how often the executor asks its gate about a trajectory that has not started."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.asked_new = 0

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        self.asked_new += not view[tid].started
        return super().may_generate(view, tid)


def test_a_state_change_re_checks_one_waiting_trajectory_not_every_one():
    """Under admission, the trajectories not started all wait at the gate. Each state change used to wake every
    one of them to re-check its gate (O(waiting) per change: a 4,096-trajectory rollout ran for over an hour);
    now the executor asks only the one ``admission_candidates`` names (the next in batch order), one check per
    change. (Measured here: 4,405 checks of not-started trajectories, 17 per trajectory; with every waiter woken on
    every change, 397,369.)"""
    policy = CountingKV()
    result, _ = rollout_on_sim(policy, 200_000, 32, 0.4)
    assert len(result.trajectories) == 256 and not any(t.error for t in result.trajectories)
    assert policy.asked_new <= 120 * 256


# ---------------------------------------------------------------------------------------------- pause
def test_pause_holds_a_history_that_does_not_fit_and_resumes_the_smallest_first():
    """ThunderAgent's pause: a started trajectory back from its tools whose history no longer fits waits at its gate;
    the held ones go on smallest history first, and no new program starts while any is held."""
    policy = KVPolicy(min_decoding=0, idle_fill=0.0, pause="always")
    decoding = busy(2, 3_000)  # 6,000 of 10,000 in use
    big, small = entry("big", Stage.GATE, 5_000, turn=3), entry("small", Stage.GATE, 4_500, turn=2)
    new = entry("n", Stage.GATE, 100, turn=0)
    v = view(*decoding, big, small, new)
    assert KVPolicy(min_decoding=0, idle_fill=0.0, pause="never").may_generate(v, "big")  # no pausing: started go
    assert not policy.may_generate(v, "big")  # 6,000 + 5,000 > 10,000: held
    assert not policy.may_generate(v, "small")  # 6,000 + 4,500 > 10,000: held, and now first in line
    assert list(policy.resume_candidates(v, ["big", "small"])) == ["small"]
    assert list(policy.admission_candidates(v, ["n"])) == [] and not policy.may_generate(v, "n")
    v = v.with_entry(entry("b0", Stage.DONE, 3_000), 1.0)  # 3,000 in use: both would fit; the smallest goes first
    assert not policy.may_generate(v, "big") and policy.may_generate(v, "small")
    v = v.with_entry(entry("small", Stage.GENERATE, 4_500, turn=2), 2.0)  # 7,500 in use: big still does not fit
    assert list(policy.resume_candidates(v, ["big"])) == ["big"] and not policy.may_generate(v, "big")
    v = v.with_entry(entry("b1", Stage.DONE, 3_000), 3.0)
    assert policy.may_generate(v, "big")  # 4,500 + 5,000 fits
    v = v.with_entry(entry("big", Stage.GENERATE, 5_000, turn=3), 4.0)
    assert list(policy.resume_candidates(v, [])) == [] and list(policy.admission_candidates(v, ["n"])) == ["n"]


def test_pause_lets_everything_go_when_the_engine_is_empty_or_reports_no_kv():
    policy = KVPolicy(min_decoding=0, idle_fill=0.0, pause="always")
    huge = entry("h", Stage.GATE, 50_000, turn=4)
    assert policy.may_generate(view(huge, entry("d", Stage.DONE, 10)), "h")  # nothing decoding: a history > pool runs
    assert policy.may_generate(view(*busy(2, 3_000), huge, kv=None), "h")
    assert not policy.may_generate(view(*busy(2, 3_000), huge), "h")
    assert list(policy.resume_candidates(view(huge), ["h", "x"])) == ["h", "x"]  # not holding back: all may go


def test_pause_by_default_only_where_the_kv_is_pooled_across_servers():
    """On one server admission sees the real pool and pausing only adds waits (README); behind a router started
    programs are held too (here with the pools summed, ``place=False``: the sum hides one server overflowing)."""
    decoding, back = busy(2, 3_000), entry("back", Stage.GATE, 5_000, turn=3)
    one, pooled = view(*decoding, back), RolloutView((*decoding, back), kv_tokens=KV, kv_pools=8)
    assert KVPolicy(min_decoding=0, idle_fill=0.0).may_generate(one, "back")
    assert not KVPolicy(min_decoding=0, idle_fill=0.0, place=False).may_generate(pooled, "back")
    assert not KVPolicy(min_decoding=0, idle_fill=0.0, pause="always").may_generate(one, "back")
    assert KVPolicy(min_decoding=0, idle_fill=0.0, pause="never", place=False).may_generate(pooled, "back")
    assert pooled.with_entry(entry("b0", Stage.TOOLS, 3_000), 1.0).kv_pools == 8
    auto = build_scheduler("auto", place=False)  # overlap+kv: the composite asks kv which held trajectory may go
    assert not auto.may_generate(pooled, "back") and list(auto.resume_candidates(pooled, ["back", "x"])) == ["back"]
    with pytest.raises(ValueError, match="pause"):
        KVPolicy(pause="sometimes")


def placed(tid: str, group: str, stage: Stage, context: int, pool: int | None, turn: int = 1) -> TrajectoryView:
    return TrajectoryView(tid, group, turn, stage, 0, context_tokens=context, kv_pool=pool)


def test_behind_a_router_kv_places_each_group_in_a_pool_and_sizes_every_pool_alone():
    """Two pools of 10,000 tokens: a history back from its tools is held while *its* pool is full, though the two
    pools summed have room; a new group goes to the pool with the least KV in use that holds nobody, its siblings
    follow it (their prompt is in that server's cache); a held history moves to a pool that has room for it."""
    policy = KVPolicy(min_decoding=0, idle_fill=0.0)
    full = [placed(f"a{i}", "a", Stage.GENERATE, 3_000, pool=0) for i in range(3)]  # pool 0: 9,000 in use
    other = placed("b0", "b", Stage.TOOLS, 8_500, pool=1)  # pool 1: 8,500
    back = placed("back", "a", Stage.GATE, 2_000, pool=0, turn=3)
    new, sibling = placed("n0", "n", Stage.GATE, 500, None, turn=0), placed("n1", "n", Stage.GATE, 500, None, turn=0)
    v = RolloutView((*full, other, back, new, sibling), kv_tokens=2 * KV, kv_pools=2)
    assert (v.pool_active_tokens(0), v.pool_active_tokens(1), v.active_tokens) == (9_000, 8_500, 17_500)
    assert KVPolicy(min_decoding=0, idle_fill=0.0, place=False).may_generate(v, "back")  # 17,500 + 2,000 <= 20,000
    assert not policy.may_generate(v, "back")  # 9,000 + 2,000 > 10,000 and 8,500 + 2,000 > 10,000: held
    assert list(policy.resume_candidates(v, ["back"])) == ["back"]
    assert policy.may_generate(v, "n0") and policy.kv_pool(v, "n0") == 1  # pool 0 holds one: the new group goes to 1
    v = v.with_entry(placed("n0", "n", Stage.GENERATE, 500, pool=1, turn=0), 1.0)
    assert v.pool_active_tokens(1) == 9_000 and v.pool_generating_tokens(1) == 500
    assert policy.kv_pool(v, "n1") == 1  # with its sibling
    v = v.with_entry(placed("b0", "b", Stage.DONE, 8_500, pool=1), 2.0)  # pool 1: 500 in use
    assert policy.may_generate(v, "back") and policy.kv_pool(v, "back") == 1  # moves where it fits
    assert policy.kv_pool(v, "back") == 1  # a function of the view: asked again, the same pool
    one = RolloutView((*full, back), kv_tokens=KV)
    assert policy.kv_pool(one, "back") is None and build_scheduler("async").kv_pool(one, "back") is None
    assert build_scheduler("auto").kv_pool(v, "a0") == 0


class CountingStartedKV(KVPolicy):
    """``kv`` that counts how often the executor asks its gate about a started trajectory."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.asked_started = 0
        self.held_max = 0

    def may_generate(self, view: RolloutView, tid: str) -> bool:
        self.asked_started += view[tid].started
        go = super().may_generate(view, tid)
        self.held_max = max(self.held_max, len(self._held_at))
        return go


def test_pause_changes_no_token_and_wakes_one_held_trajectory_per_change():
    """On the simulated engine under KV pressure: the same tokens as ``async`` (R1), fewer recomputed, and each
    state change re-checks the one held trajectory ``resume_candidates`` names, not every held one. (Measured here:
    7,993 checks of started trajectories, up to 39 held at once; waking every held one on every change: 64,250.)"""
    counting = CountingStartedKV(pause="always")
    (paused, paused_prefill), (plain, plain_prefill) = (rollout_on_sim(p, 200_000, 32, 0.4)
                                                        for p in (counting, build_scheduler("async")))
    assert tokens_by_trajectory(paused) == tokens_by_trajectory(plain)
    assert len(paused.trajectories) == 256 and not any(t.error for t in paused.trajectories)
    assert counting.held_max > 20  # the pause happened, to many at once
    assert paused_prefill < 0.5 * plain_prefill
    assert counting.asked_started <= 40 * 256


class RecordingPlacement(KVPolicy):
    """``kv`` that records the pools it names per trajectory."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.pools: dict[str, list[int | None]] = {}

    def kv_pool(self, view, tid):
        pool = super().kv_pool(view, tid)
        self.pools.setdefault(tid, []).append(pool)
        return pool


def test_placing_programs_on_two_servers_changes_no_token_and_cuts_recompute():
    """256 agents on two simulated servers of 100k tokens of KV each: ``kv`` places each group in one server's pool
    and sizes every pool alone — the same tokens as ``async`` (R1), under half its prefill, both servers used, a
    group's members starting together. (Measured: prefill 2.70M against async's 6.46M and 2.97M with the pools
    summed, ``place=False``; makespan 217 virtual s against 168 s for ``async`` — at this scale holding programs
    back costs more than the recompute it saves, as on ``code-tool``, README.)"""
    placing = RecordingPlacement()
    (placed_run, placed_prefill), (plain, plain_prefill) = (rollout_on_sim(p, 100_000, 32, 0.4, servers=2)
                                                            for p in (placing, build_scheduler("async")))
    assert tokens_by_trajectory(placed_run) == tokens_by_trajectory(plain)
    assert len(placed_run.trajectories) == 256 and not any(t.error for t in placed_run.trajectories)
    assert placed_prefill < 0.5 * plain_prefill
    first = {tid: pools[0] for tid, pools in placing.pools.items()}
    assert set(first.values()) == {0, 1}
    by_group: dict[str, set] = {}
    for t in placed_run.trajectories:
        by_group.setdefault(t.group_id, set()).add(first[t.id])
    assert len(by_group) == 32 and all(len(pools) == 1 for pools in by_group.values())
