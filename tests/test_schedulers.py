"""Scheduling policies: pure decision logic on hand-built views (no engine, no clock), then the executor on the
scripted engine (scheduling logic) and on the embedded engine (R1 parity, prefix sharing, preemption)."""

import inspect
import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from rollopt import ChatRenderer, ConfigError, LocalEngine, LocalEngineConfig, RolloutExecutor, SamplingParams
from rollopt import ScriptedEngine, Status, episode_specs, run_rollout
from rollopt.environments import CalculatorEnv, SyntheticEnv
from rollopt.schedulers import (
    SCHEDULERS, Policy, PreemptPolicy, RiskClass, RolloutView, Stage, SyncPolicy, TrajectoryView, build_scheduler,
    parse_spec, register_scheduler, split_specs,
)


def view(*trajs, target=None):
    return RolloutView(tuple(TrajectoryView(*t) for t in trajs), target)


# ---------------------------------------------------------------------------------------------- pure logic
def test_sync_barrier_releases_a_turn_only_when_all_live_trajectories_reached_it():
    policy = SyncPolicy()
    waiting = view(("a", "g", 1, Stage.GATE, 10), ("b", "g", 0, Stage.TOOLS, 8), ("c", "h", 3, Stage.DONE, 5))
    assert not policy.may_generate(waiting, "a")
    ready = view(("a", "g", 1, Stage.GATE, 10), ("b", "g", 1, Stage.GATE, 8), ("c", "h", 3, Stage.DONE, 5))
    assert policy.may_generate(ready, "a") and policy.may_generate(ready, "b")
    started = view(("a", "g", 1, Stage.GATE, 10), ("b", "g", 1, Stage.GENERATE, 8))
    assert policy.may_generate(started, "a")  # b was released first; a may follow
    preempted_do_not_block = view(("a", "g", 1, Stage.GATE, 10), ("b", "g", 0, Stage.PREEMPTED, 8))
    assert policy.may_generate(preempted_do_not_block, "a")
    # tools of turn 1 wait until every live trajectory has decoded turn 1
    assert not policy.may_run_tools(view(("a", "g", 1, Stage.TOOLS, 10), ("b", "g", 1, Stage.GENERATE, 8)), "a")
    assert policy.may_run_tools(view(("a", "g", 1, Stage.TOOLS, 10), ("b", "g", 1, Stage.TOOLS, 8)), "a")
    assert policy.may_run_tools(view(("a", "g", 1, Stage.TOOLS, 10), ("b", "g", 2, Stage.GATE, 8)), "a")


def test_preempt_fires_at_quota_and_spares_old_carry_overs():
    policy = PreemptPolicy(max_carry_age=1)
    trajs = [("a0", "A", 2, Stage.DONE, 50), ("a1", "A", 2, Stage.DONE, 40),
             ("b0", "B", 1, Stage.GENERATE, 30), ("b1", "B", 3, Stage.DONE, 90),
             ("c0", "C", 0, Stage.TOOLS, 10, 0), ("c1", "C", 0, Stage.GATE, 10, 1)]
    assert policy.preempt(view(*trajs, target=2)) == set()  # only group A is complete
    assert policy.preempt(view(*trajs, target=1)) == {"b0", "c0"}  # c1 was carried over once: exempt
    assert policy.preempt(view(*trajs)) == set()  # no quota: nothing to preempt
    budget = PreemptPolicy(token_budget=200)
    assert budget.preempt(view(*trajs)) == {"b0", "c0"}  # 240 tokens >= 200; c1 still exempt
    assert PreemptPolicy(token_budget=10_000).preempt(view(*trajs)) == set()


def test_prefix_priority_keeps_groups_together():
    policy = build_scheduler("prefix")
    v = view(("a0", "A", 0, Stage.GATE, 0), ("b0", "B", 0, Stage.GATE, 0), ("a1", "A", 0, Stage.GATE, 0))
    assert policy.priority(v, "a0") == policy.priority(v, "a1") > policy.priority(v, "b0")


def test_las_runs_the_least_served_trajectory_first():
    policy = build_scheduler("las")
    v = view(("long", "A", 3, Stage.GATE, 300), ("short", "B", 1, Stage.GATE, 20), ("new", "C", 0, Stage.GATE, 0))
    assert policy.priority(v, "new") > policy.priority(v, "short") > policy.priority(v, "long")


def test_warm_asks_for_a_ttl_and_combinations_keep_the_longest():
    assert build_scheduler("overlap").keep_warm_s == 0
    assert build_scheduler("overlap+warm", keep_warm_s=12.5).keep_warm_s == 12.5
    with pytest.raises(ValueError, match="keep_warm_s"):
        build_scheduler("warm", keep_warm_s=0)


def test_a_view_derived_by_one_changed_entry_answers_like_a_view_built_from_scratch():
    """The executor derives each snapshot from the last one (with_entry); its counts must equal a rebuild's."""
    rng = random.Random(0)
    entries = [TrajectoryView(f"t{i}", f"g{i // 4}", 0, Stage.GATE, 0) for i in range(150)]  # 3 chunks of Entries
    derived = RolloutView(tuple(entries), target_groups=2)
    stages = [*Stage, *[Stage.DONE] * 6]  # DONE often enough that groups complete, and undo
    kept = []

    def answers(view):
        return (view.min_live_turn, view.complete_groups(), view.num_complete_groups, view.generated_tokens,
                [view.live_not_in_tools(turn) for turn in range(6)])

    for step in range(600):
        i = rng.randrange(len(entries))
        old = entries[i]
        entries[i] = TrajectoryView(old.id, old.group_id, old.turn + rng.randint(0, 1), rng.choice(stages),
                                    old.generated_tokens + rng.randint(0, 9), old.carry_age,
                                    context_tokens=old.context_tokens + rng.randint(0, 50))
        derived = derived.with_entry(entries[i], now=float(step))
        rebuilt = RolloutView(tuple(entries), target_groups=2)
        assert derived.trajectories == rebuilt.trajectories == tuple(entries) and derived.now == step
        assert list(derived.trajectories) == entries and derived.trajectories[-1] is entries[-1]
        assert derived.min_live_turn == rebuilt.min_live_turn == min((t.turn for t in entries if t.live), default=None)
        assert derived.complete_groups() == rebuilt.complete_groups()
        complete = [g for g in derived.group_order if all(t.stage is Stage.DONE for t in entries if t.group_id == g)]
        assert [g for g in derived.group_order if derived.group_complete(g)] == complete
        assert derived.num_complete_groups == rebuilt.num_complete_groups == len(complete)
        assert derived.generated_tokens == rebuilt.generated_tokens == sum(t.generated_tokens for t in entries)
        in_use = sum(t.context_tokens for t in entries if t.stage in (Stage.GENERATE, Stage.TOOLS))
        assert derived.active_tokens == rebuilt.active_tokens == in_use
        decoding = sum(t.context_tokens for t in entries if t.stage is Stage.GENERATE)
        assert derived.generating_tokens == rebuilt.generating_tokens == decoding
        for turn in range(0, 6):
            expected = sum(t.live and t.turn == turn and t.stage is not Stage.TOOLS for t in entries)
            assert derived.live_not_in_tools(turn) == rebuilt.live_not_in_tools(turn) == expected
        assert derived[entries[i].id] is entries[i]
        kept.append((derived, answers(derived)))
    assert all(answers(view) == before for view, before in kept)  # later changes never alter a snapshot


def test_scripted_engine_counts_the_longest_prefix_shared_with_any_earlier_sequence():
    engine = ScriptedEngine(lambda r: [])
    rng = random.Random(1)
    earlier: list[tuple[int, ...]] = []
    for _ in range(300):
        if earlier and rng.random() < 0.7:
            base = rng.choice(earlier)
            ids = base[: rng.randint(0, len(base))] + tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 5)))
        else:
            ids = tuple(rng.randint(0, 70_000) for _ in range(rng.randint(0, 8)))
        shared = max((next((k for k, (a, b) in enumerate(zip(ids, e)) if a != b), min(len(ids), len(e)))
                      for e in earlier), default=0)
        assert engine._cached(ids) == max(0, min(shared, len(ids) - 1))  # the last prompt token is always computed
        engine._remember(ids)
        earlier.append(ids)


def test_build_scheduler_combines_by_name():
    combo = build_scheduler("overlap+prefix+preempt", max_carry_age=3)
    assert combo.name == "overlap+prefix+preempt" and combo.risk_class is RiskClass.R3
    assert combo.early_tool_start and combo.shared_prefill and not combo.barrier
    assert combo.parts[2].max_carry_age == 3
    assert build_scheduler("sync").risk_class is RiskClass.R1
    # only a policy that defines preempt (alone or as a part) makes the executor ask it and guard tool calls
    assert combo.preempts and build_scheduler("preempt").preempts
    assert not any(build_scheduler(n).preempts for n in ("sync", "overlap", "overlap+prefix", "async+warm"))
    for bad, words in [("sync+overlap", "cannot be combined"), ("fast", "unknown scheduler"),
                       ("overlap+overlap", "twice")]:
        with pytest.raises(ConfigError, match=words):
            build_scheduler(bad)
    with pytest.raises(ConfigError, match="not accepted"):
        build_scheduler("overlap", max_carry_age=2)


def test_a_part_takes_its_own_options_in_brackets():
    """``kv[idle_fill=0,min_decoding=0]``: options for one part, TOML values, the rest of the spec unchanged; an option
    the part does not take or a value it refuses is a ConfigError naming the part."""
    combo = build_scheduler("overlap+kv[idle_fill=0,min_decoding=0,pause=never]")
    kv = combo.parts[1]
    assert (kv.idle_fill, kv.min_decoding, kv.pause, kv.fill) == (0, 0, "never", 1.0)
    auto = build_scheduler("auto[idle_fill=0.25,min_decoding=4]").parts[1]
    assert (auto.idle_fill, auto.min_decoding) == (0.25, 4)
    assert split_specs("async, auto[idle_fill=0,min_decoding=0],kv[pause=never]") == (
        "async", "auto[idle_fill=0,min_decoding=0]", "kv[pause=never]")
    for bad, words in [("kv[foo=1]", "'kv' has no option \\['foo'\\]"), ("kv[idle_fill=3]", "'kv': idle_fill must be"),
                       ("kv[idle_fill]", "not key=value"), ("kv[[x]]", "not NAME"), ("kv[fill=0.5", "not NAME")]:
        with pytest.raises(ConfigError, match=words):
            build_scheduler(bad)


_option_value = st.one_of(st.integers(-10**6, 10**6), st.booleans(),
                          st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True).filter(
                              lambda w: w not in ("true", "false", "inf", "nan")),  # TOML's words are not strings
                          st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 3)))


def _format(value):
    return str(value).lower() if isinstance(value, bool) else str(value)


@given(st.lists(st.tuples(st.sampled_from(sorted(SCHEDULERS)),
                          st.dictionaries(st.from_regex(r"[a-z][a-z_]{0,10}", fullmatch=True), _option_value,
                                          max_size=3)), min_size=1, max_size=4))
def test_specs_split_and_parse_back_to_their_names_and_options(parts):
    """Whatever the options, a spec list splits at its top-level commas and each part parses back exactly."""
    specs = [f"{name}[{','.join(f'{k}={_format(v)}' for k, v in opts.items())}]" if opts else name
             for name, opts in parts]
    assert split_specs(",".join(specs)) == tuple(specs)
    assert parse_spec("+".join(specs)) == [(name, opts) for name, opts in parts]


_hostile_value = st.sampled_from(["-1", "0", "3", "1e9", "nan", "inf", "-inf", "true", "never", '"x"', "[1, 2]", "",
                                  "{a = 1}", "0.5"])


def _with_own_options(name):
    """``name`` with up to three of its own constructor options, each given a value it may refuse."""
    parameters = sorted(inspect.signature(SCHEDULERS[name]).parameters) or ["unknown_option"]
    return st.lists(st.tuples(st.sampled_from(parameters), _hostile_value), min_size=1, max_size=3).map(
        lambda options: f"{name}[{','.join(f'{k}={v}' for k, v in options)}]")


_option_spec = st.sampled_from(sorted(SCHEDULERS)).flatmap(_with_own_options)


@given(st.one_of(_option_spec, _option_spec, st.lists(_option_spec, min_size=2, max_size=3).map("+".join),
                 st.text(alphabet="akvsyncoverlap+[]=,.0123 _-\"'", max_size=40)))
@example("kv[fill=3]")
@example("preempt[max_carry_age=never]")
def test_any_scheduler_spec_builds_or_is_a_config_error(spec):
    """Hostile specs — real option names with out-of-range or mistyped values, or any text — never raise anything
    but ConfigError (the CLI turns it into one line naming the fix)."""
    try:
        assert isinstance(build_scheduler(spec), Policy)
    except ConfigError:
        pass


def test_every_shipped_policy_declares_a_risk_class_and_unclassed_ones_are_refused():
    assert {"sync", "overlap", "prefix", "preempt"} <= set(SCHEDULERS)
    assert all(isinstance(f.risk_class, RiskClass) for f in SCHEDULERS.values())

    class Unclassed(Policy):
        name = "unclassed"

    with pytest.raises(ConfigError, match="risk class"):
        register_scheduler("unclassed", Unclassed)


# ---------------------------------------------------------------------------------------------- scripted engine
def call(expr):
    return f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


async def test_overlap_starts_a_tool_while_its_turn_still_decodes(tokenizer):
    renderer = ChatRenderer(tokenizer)
    turn0 = renderer.encode(call("2 * 3") + " and some more text after the call") + [renderer.end_of_turn_id]

    def script(request):
        return turn0 if ".t0." in request.rid else renderer.encode("<answer>6</answer>") + [renderer.end_of_turn_id]

    results = {}
    for policy in ("sync", "overlap"):
        engine = ScriptedEngine(script, token_delay_s=0.002, eos_token_id=renderer.end_of_turn_id)
        result = await RolloutExecutor(CalculatorEnv(), engine, renderer, policy).run(
            episode_specs(CalculatorEnv().tasks(1, 0), 1, SamplingParams(max_new_tokens=200), seed=0))
        graph = result.graph
        [(_, gen)] = [(n, d) for n, d in graph.nodes("generate") if d["turn"] == 0]
        [(_, tool_node)] = graph.nodes("tool")
        results[policy] = (tool_node["start"] < gen["end"], result.trajectories[0])
    assert results["overlap"][0] and not results["sync"][0]
    a, b = results["sync"][1], results["overlap"][1]
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert [r.content for r in a.tool_results] == [r.content for r in b.tool_results] == ["6"]


async def test_sync_runs_turns_in_lockstep(tokenizer):
    renderer = ChatRenderer(tokenizer)
    end = renderer.end_of_turn_id

    def script(request):  # trajectory s0 needs 3 tool turns, s1 only 1
        turn = int(request.rid.split(".t")[1].split(".")[0])
        tool_turns = 3 if ".s0." in request.rid else 1
        return renderer.encode(call("1 + 1") if turn < tool_turns else "<answer>2</answer>") + [end]

    engine = ScriptedEngine(script, token_delay_s=0.001, eos_token_id=end)
    env = CalculatorEnv()
    result = await RolloutExecutor(env, engine, renderer, "sync").run(
        episode_specs(env.tasks(1, 0), 2, SamplingParams(max_new_tokens=100), seed=0))
    gens = sorted((d["turn"], d["start"], d["end"], d["trajectory"]) for _, d in result.graph.nodes("generate"))
    tools = [(d["start"], d["end"]) for _, d in result.graph.nodes("tool")]
    for turn in (1, 2):  # every turn t request starts after every turn t-1 request (and its tools) ended
        prev_end = max(e for t, s, e, _ in gens if t == turn - 1)
        assert all(s >= prev_end for t, s, e, _ in gens if t == turn)
    turn0_end = max(e for t, s, e, _ in gens if t == 0)
    assert sum(s >= turn0_end for s, _ in tools) == len(tools)  # no tool starts before the turn is decoded
    assert [len(t.turns) for t in result.trajectories] == [4, 2]


# ---------------------------------------------------------------------------------------------- embedded engine
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def local(model, **cfg):
    return LocalEngine(model.config, model.state_dict(), LocalEngineConfig(**{"max_running": 16, "max_context": 1024,
                                                                             **cfg}))


async def test_r1_sync_overlap_prefix_give_identical_greedy_tokens(tokenizer, peaked_model):
    env = SyntheticEnv(turns=(1, 3), tokens_per_turn=(4, 12), tool_latency_s=0.002)
    renderer = ChatRenderer(tokenizer)
    specs = episode_specs(env.tasks(4, 0), 3, GREEDY, seed=0, fork_after_turn=0, fork_branches=2)
    tokens = {}
    for policy in ("sync", "overlap", "prefix", "overlap+prefix", "overlap+warm+las"):
        async with local(peaked_model) as engine:
            trajs = await run_rollout(env, engine, renderer, specs, policy)
        tokens[policy] = {t.id: t.token_ids.tolist() for t in trajs}
        assert all(t.status is Status.COMPLETED for t in trajs)
    assert len(tokens["sync"]) > 12  # forks added branches
    assert max(len(t) for t in tokens["sync"].values()) > min(len(t) for t in tokens["sync"].values())
    for policy in ("overlap", "prefix", "overlap+prefix", "overlap+warm+las"):
        assert tokens[policy] == tokens["sync"], policy


async def test_prefix_computes_a_group_prompt_once(tokenizer, peaked_model):
    env = CalculatorEnv()
    renderer = ChatRenderer(tokenizer)
    specs = episode_specs(env.tasks(2, 0), 8, SamplingParams(max_new_tokens=8, temperature=1.0), seed=0)
    engine = local(peaked_model, defer_shared_prefill=False)
    naive = 0
    original_stream = engine.stream

    def counting_stream(request):
        nonlocal naive
        naive += len(request.input_ids) if request.sampling.max_new_tokens > 0 else 0
        return original_stream(request)

    engine.stream = counting_stream
    async with engine:
        await run_rollout(env, engine, renderer, specs, "overlap+prefix")
    assert engine.stats.prefill_tokens <= (1 / 8 + 0.05) * naive, (engine.stats.prefill_tokens, naive)
    assert engine.stats.cached_tokens > 0


async def test_preempt_carries_stragglers_over_and_loses_no_token(tokenizer, peaked_model):
    env = SyntheticEnv(turns=(1, 3), tokens_per_turn=(6, 10), tool_latency_s=0.003, long_tail_fraction=0.4,
                       long_tail_factor=8)
    renderer = ChatRenderer(tokenizer)
    specs = episode_specs(env.tasks(6, 1), 2, SamplingParams(max_new_tokens=1, temperature=1.0), seed=0)
    async with local(peaked_model) as engine:
        executor = RolloutExecutor(env, engine, renderer, build_scheduler("overlap+preempt", max_carry_age=1))
        batches = [await executor.run(specs, target_groups=3)]
        streamed = batches[0].tokens_streamed
        first_carried = {r.id: r.trajectory.num_generated for r in executor.carry}
        update_version = await engine.update_weights(peaked_model.state_dict())
        while executor.carry:
            batches.append(await executor.run([], target_groups=None))
            streamed += batches[-1].tokens_streamed
            assert len(batches) <= 3, "a carried-over trajectory starved"
    assert batches[0].preempted > 0 and len(batches[0].trajectories) == 6
    returned = [t for b in batches for t in b.trajectories]
    assert len(returned) == 12 and len({t.id for t in returned}) == 12
    # every streamed token is in exactly one returned trajectory: none lost, none duplicated
    assert sum(t.num_generated for t in returned) == streamed
    resumed = [t for t in returned if t.id in first_carried]
    assert any(first_carried[t.id] > 0 for t in resumed)
    for t in resumed:
        versions = t.versions[t.loss_mask].tolist()
        n_old = first_carried[t.id]
        # tokens sampled before preemption keep version 0; those after the update carry the new version
        assert versions[:n_old] == [0] * n_old and set(versions[n_old:]) <= {update_version}
        assert t.status is Status.COMPLETED
        planned = sum(p.tokens for p in next(s.task for s in specs if s.trajectory_id == t.id).info["plan"])
        assert t.num_generated == planned  # resumed exactly where it stopped
