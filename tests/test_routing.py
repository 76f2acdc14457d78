"""The multi-server router without servers: placement logic (pure), then RoutedEngine over scripted engines
(failover with exact token continuity, drain, fan-out, versions, and the executor's group affinity). The same
router against two real SGLang servers is tests/test_routed_sglang.py."""

from __future__ import annotations

from contextlib import aclosing

import anyio
import pytest

from rollopt import BadRequestError, ChatRenderer, ConfigError, EngineError, EngineFailure, FinishReason
from rollopt import GenerateRequest
from rollopt import GenerateResult, SamplingParams, ScriptedEngine, episode_specs, run_rollout
from rollopt.engines.routed import AllServersFailed, RoutedEngine, VersionMismatch
from rollopt.engines.routing import AffinityRouter, NoHealthyServer, affinity_key
from rollopt.environments import SyntheticEnv
from rollopt.schedulers import Policy, RiskClass


def counting(request: GenerateRequest) -> list[int]:
    """Each token is the previous one + 1 (mod 500): the continuation of any prefix is the uninterrupted output."""
    last = request.input_ids[-1]
    return [(last + 1 + i) % 500 for i in range(request.sampling.max_new_tokens)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


def key_preferring(router: AffinityRouter, server: int) -> str:
    return next(k for k in (f"k{i}" for i in range(100)) if router.preference("key:" + k)[0] == server)


# ---------------------------------------------------------------------------------------------- placement
def test_bounded_load_places_a_burst_of_groups_evenly_and_pins_each_group():
    router = AffinityRouter(["s0", "s1"], epsilon=0.1)
    placed = {}
    for g in range(8):  # 8 groups of 4 requests, all in flight together (a GRPO batch issued at once)
        placed[g] = [router.route(f"key:g{g}") for _ in range(4)]
    assert all(len(set(p)) == 1 for p in placed.values())  # a group never splits
    assert router.in_flight == [16, 16]
    assert [router.pinned(f"key:g{g}") for g in range(8)] == [p[0] for p in placed.values()]
    for g, p in placed.items():
        for i in p:
            router.release(i)
    assert router.in_flight == [0, 0]
    assert router.route("key:g0") == placed[0][0]  # pinned: the next turn goes where the prefix is cached
    with pytest.raises(RuntimeError, match="without a matching route"):
        router.release(1 - placed[0][0])


def test_prefill_burst_then_members_balance_exactly():
    """The executor's prefix policy sends one prefill per group first, then the members: 8 groups → 4 + 4."""
    router = AffinityRouter(["s0", "s1"], epsilon=0.1)
    servers = [router.route(f"key:g{g}") for g in range(8)]
    assert sorted(servers) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_pinned_key_moves_off_a_server_far_behind_the_others_and_stays_pinned_there():
    """sgl-model-gateway's cache_aware balance rule: a key stays with its cached prefix until its server's
    in-flight count exceeds the least loaded one's by more than ``rebalance_abs`` and ``rebalance_rel`` times."""
    router = AffinityRouter(["s0", "s1", "s2"], rebalance_abs=4, rebalance_rel=1.5)
    home = router.route("key:g")
    router.release(home)
    other = [i for i in range(3) if i != home]
    router.in_flight = [0, 0, 0]
    router.in_flight[home], router.in_flight[other[0]], router.in_flight[other[1]] = 9, 5, 6  # 9 - 5 = 4: not > 4
    assert router.route("key:g") == home and router.moves == 0
    router.in_flight[home] = 10  # 10 - 5 > 4 and 10 > 1.5 × 5: moves to the least loaded
    assert router.route("key:g") == other[0] and router.pinned("key:g") == other[0] and router.moves == 1
    router.in_flight[home], router.in_flight[other[0]] = 5, 8  # back home is lighter, but not by far
    assert router.route("key:g") == other[0] and router.moves == 1


def test_without_rebalancing_a_pin_never_moves_for_load():
    router = AffinityRouter(["s0", "s1"], rebalance_abs=None)
    home = router.route("key:g")
    router.in_flight[home] = 1000
    assert router.route("key:g") == home and router.moves == 0
    with pytest.raises(ConfigError):
        AffinityRouter(["s0", "s1"], rebalance_rel=0.5)


def test_a_placed_request_goes_to_its_server_while_healthy_and_takes_its_key_there():
    """``GenerateRequest.kv_pool``: the caller places the request (a policy sizing each server's KV); no rebalancing
    moves it, and an unhealthy or unknown server falls back to the router's own placement."""
    router = AffinityRouter(["s0", "s1", "s2"], rebalance_abs=0, rebalance_rel=1.0)
    router.in_flight = [50, 0, 0]
    assert router.route("key:g", server=0) == 0 and router.pinned("key:g") == 0 and router.moves == 0
    assert router.route("key:g") == 1 and router.moves == 1  # unplaced, the same key rebalances as before
    router.mark_unhealthy(2)
    assert router.route("key:h", server=2) != 2 and router.route("key:i", server=7) in (0, 1)


def test_rendezvous_order_is_a_function_of_names_and_key_and_unhealthy_servers_lose_their_pins():
    a, b = AffinityRouter(["x", "y", "z"]), AffinityRouter(["x", "y", "z"])
    assert [a.preference(f"key:{i}") for i in range(20)] == [b.preference(f"key:{i}") for i in range(20)]
    first = a.route("key:7")
    a.release(first)
    a.mark_unhealthy(first)
    assert a.pinned("key:7") is None and first not in a.preference("key:7")
    assert a.route("key:7") == a.preference("key:7")[0] != first
    a.mark_unhealthy(0), a.mark_unhealthy(1), a.mark_unhealthy(2)
    with pytest.raises(NoHealthyServer):
        a.route("key:8")


def test_affinity_key_is_explicit_or_the_prompt_head():
    r = GenerateRequest("r", (1, 2, 3, 4), affinity="group-9")
    assert affinity_key(r, 2) == "key:group-9"
    same_head = affinity_key(GenerateRequest("a", (1, 2, 3)), 2) == affinity_key(GenerateRequest("b", (1, 2, 9)), 2)
    assert same_head and affinity_key(GenerateRequest("a", (1, 2)), 2) != affinity_key(GenerateRequest("b", (1, 3)), 2)


async def test_flush_forgets_the_pins_so_the_next_run_is_placed_by_its_own_loads():
    """A benchmark flushes between policies: the second run must not inherit the first run's placement (a pin
    points at a cached prefix, and the flush dropped it)."""
    backends = [ScriptedEngine(counting) for _ in range(2)]
    async with RoutedEngine(backends, names=["a", "b"]) as engine:
        key = key_preferring(engine.router, 0)
        busy = key_preferring(engine.router, 1)
        engine.router.in_flight = [5, 0]  # server a loaded when `key` first arrives: bounded load sends it to b
        assert engine.router.route("key:" + key) == 1
        engine.router.release(1)
        engine.router.in_flight = [0, 0]
        assert engine.router.route("key:" + key) == 1  # pinned, though a is now its preferred and idle
        engine.router.release(1)
        await engine.flush_cache()
        assert engine.router.pinned("key:" + key) is None and engine.router.pinned("key:" + busy) is None
        assert engine.router.route("key:" + key) == 0  # placed afresh: its rendezvous choice
        engine.router.release(0)


# ---------------------------------------------------------------------------------------------- failover
class Failing(ScriptedEngine):
    """Fails a request with :class:`EngineFailure` once ``fail_after`` of its tokens were streamed; its partial
    holds one token more than was streamed (received but not yet passed on when the connection dropped). With
    ``dies`` the whole server is then gone: its other streams fail at their next token, new ones at once, and
    aborts and health checks fail; without it only that request fails and the server keeps serving."""

    def __init__(self, *args, fail_after: int, dies: bool, **kw) -> None:
        super().__init__(*args, **kw)
        self.fail_after, self.dies, self.dead, self.failed = fail_after, dies, False, False

    async def stream(self, request):
        out: list[int] = []
        async with aclosing(super().stream(request)) as chunks:
            async for chunk in chunks:
                if self.dead:
                    raise EngineFailure("connection lost", self._partial(request, out))
                if not self.failed and len(out) >= self.fail_after:
                    self.failed, self.dead = True, self.dies
                    raise EngineFailure("HTTP 500", self._partial(request, out + chunk.token_ids))
                out += chunk.token_ids
                yield chunk

    def _partial(self, request, ids):
        return GenerateResult(request.rid, list(ids), [self.logprob] * len(ids), [self.version] * len(ids),
                              FinishReason.ABORT, len(request.input_ids), 0)

    async def abort(self, rid: str) -> None:
        if self.dead:
            raise EngineError("connection refused")
        await super().abort(rid)

    async def health(self) -> bool:
        return not self.dead


@pytest.mark.parametrize("dies", [True, False], ids=["server-dies", "one-request-fails"])
async def test_requests_of_a_failed_server_resume_elsewhere_with_every_token_once(dies):
    n = 40
    failing = Failing(counting, token_delay_s=0.002, fail_after=5, dies=dies)
    healthy = ScriptedEngine(counting, token_delay_s=0.002)
    async with RoutedEngine([failing, healthy], names=["a", "b"]) as engine:
        key = key_preferring(engine.router, 0)
        prompts = [(10,), (100,), (200, 201)]
        chunks: dict[int, list] = {i: [] for i in range(3)}
        results = {}

        async def run(i):
            async for chunk in engine.stream(GenerateRequest(f"r{i}", prompts[i], greedy(n), affinity=key)):
                chunks[i].append(chunk)
                if chunk.result is not None:
                    results[i] = chunk.result
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(run, i)
        stats = engine.stats()
    for i, prompt in enumerate(prompts):
        res = results[i]
        assert res.finish_reason is FinishReason.LENGTH and res.output_ids == counting(GenerateRequest("x", prompt,
                                                                                                     greedy(n)))
        assert sum((c.token_ids for c in chunks[i]), []) == res.output_ids  # each token yielded exactly once
        assert sum((c.logprobs for c in chunks[i]), []) == res.logprobs and len(res.versions) == n
        assert res.prompt_tokens == len(prompt)
    assert [s.healthy for s in stats] == [False, True] and stats[0].requests == 3 and stats[1].requests == 3
    assert stats[0].generated_tokens + stats[1].generated_tokens == 3 * n  # nothing lost, nothing twice
    assert stats[0].failures == (3 if dies else 1)  # otherwise the other two were drained (aborted), not failed
    for resumed in healthy.requests:  # each resumed from its own tokens so far, for the rest of its budget
        i = int(resumed.rid[1:])
        k = len(resumed.input_ids) - len(prompts[i])
        assert 0 < k < n and resumed.sampling.max_new_tokens == n - k
        assert resumed.input_ids == prompts[i] + tuple(results[i].output_ids[:k])


async def test_no_healthy_server_left_raises_engine_failure_with_the_partial():
    only = Failing(counting, token_delay_s=0.001, fail_after=3, dies=True)
    async with RoutedEngine([only], names=["a"]) as engine:
        streamed = []
        with pytest.raises(AllServersFailed) as info:
            async for chunk in engine.stream(GenerateRequest("r", (7,), greedy(10))):
                streamed += chunk.token_ids
        assert isinstance(info.value, EngineFailure) and info.value.partial.output_ids == streamed == [8, 9, 10, 11]
        assert "a: EngineFailure" in str(info.value)  # the message says what took each server out
        assert not await engine.health()


async def test_a_stream_that_ends_without_a_result_counts_as_a_failure_of_its_server():
    class Truncating(ScriptedEngine):  # breaks the Engine contract: stops after 3 tokens, no result
        async def stream(self, request):
            async with aclosing(super().stream(request)) as chunks:
                async for chunk in chunks:
                    if chunk.result is None and len(request.input_ids) == 1:
                        yield chunk
                        if chunk.token_ids[0] == request.input_ids[0] + 3:
                            return

    broken, healthy = Truncating(counting), ScriptedEngine(counting)
    async with RoutedEngine([broken, healthy], names=["a", "b"]) as engine:
        key = key_preferring(engine.router, 0)
        res = await engine.generate(GenerateRequest("r", (1,), greedy(10), affinity=key))
        assert res.output_ids == list(range(2, 12)) and [s.healthy for s in engine.stats()] == [False, True]
        assert "ended without a result" in engine.stats()[0].last_error


async def test_caller_abort_ends_the_request_with_its_tokens_and_is_not_resumed():
    a, b = ScriptedEngine(counting, token_delay_s=0.005), ScriptedEngine(counting, token_delay_s=0.005)
    async with RoutedEngine([a, b], names=["a", "b"]) as engine:
        got = []
        async for chunk in engine.stream(GenerateRequest("r", (1,), greedy(200))):
            got += chunk.token_ids
            if len(got) == 3:
                await engine.abort("r")
            if chunk.result is not None:
                res = chunk.result
        assert res.finish_reason is FinishReason.ABORT and res.output_ids == got and 3 <= len(got) < 200
        assert sum(s.requests for s in engine.stats()) == 1 and engine.server_of("r") is None


# ---------------------------------------------------------------------------------------------- fan-out
async def test_weights_pause_and_flush_fan_out_and_versions_are_checked():
    a, b = ScriptedEngine(counting, token_delay_s=0.005), ScriptedEngine(counting, token_delay_s=0.005)
    async with RoutedEngine([a, b], names=["a", "b"]) as engine:
        assert await engine.update_weights({}) == 1 and a.version == b.version == 1
        assert [s.version for s in engine.stats()] == [1, 1] and (await engine.info()).version == 1
        with pytest.raises(BadRequestError, match="not after"):
            await engine.update_weights({}, version=1)
        keys = [key_preferring(engine.router, i) for i in (0, 1)]
        results = {}

        async def run(i):
            results[i] = await engine.generate(GenerateRequest(f"p{i}", (3,), greedy(500), affinity=keys[i]))

        async with anyio.create_task_group() as tg:
            for i in (0, 1):
                tg.start_soon(run, i)
            await anyio.sleep(0.03)
            await engine.pause("abort")  # aborts what runs on both servers
            await engine.resume()
        assert all(r.finish_reason is FinishReason.ABORT and 0 < len(r.output_ids) < 500 for r in results.values())
        assert [s.requests for s in engine.stats()] == [1, 1]  # an abort the caller caused is not resumed
        await engine.flush_cache()
    b.version = 3
    with pytest.raises(VersionMismatch) as mismatch:
        async with RoutedEngine([a, b], names=["a", "b"]):
            pass
    assert mismatch.value.versions == {"a": 1, "b": 3}


async def test_the_executor_keeps_every_request_of_a_group_on_one_server(tokenizer):
    """run_rollout over the router: the executor's requests carry the group id as affinity key, so a group's
    shared prefill, its members and all their later turns land on one server, and 8 groups split 4/4."""
    env = SyntheticEnv(turns=(2, 2), tokens_per_turn=(3, 5), tool_latency_s=0.001)
    backends = [ScriptedEngine(lambda r: [5] * r.sampling.max_new_tokens, token_delay_s=0.001) for _ in range(2)]
    specs = episode_specs(env.tasks(8, 0), 4, SamplingParams(temperature=0), seed=0)
    async with RoutedEngine(backends, names=["a", "b"]) as engine:
        trajs = await run_rollout(env, engine, ChatRenderer(tokenizer), specs, "overlap+prefix")
    assert len(trajs) == 32 and all(t.error is None for t in trajs)
    where = {}
    for i, backend in enumerate(backends):
        for request in backend.requests:
            where.setdefault(request.affinity, set()).add(i)
    assert sorted(where) == sorted({s.group_id for s in specs}) and all(len(s) == 1 for s in where.values())
    assert sorted(len(b.requests) for b in backends) == [4 * (1 + 4 * 2)] * 2  # per group: prefill + 4 × 2 turns


class PlacingPolicy(Policy):
    """Puts sample ``….sK`` of each group in pool K mod 2: the router's own placement keeps a group together, so
    only the policy's placement explains where a request lands."""

    name = "placing"
    risk_class = RiskClass.R1

    def kv_pool(self, view, tid):
        return int(tid.rsplit(".s", 1)[1]) % 2


async def test_the_executor_sends_each_request_to_the_pool_the_policy_names(tokenizer):
    """``Policy.kv_pool`` → ``GenerateRequest.kv_pool`` → that server, for every turn of every trajectory."""
    env = SyntheticEnv(turns=(2, 2), tokens_per_turn=(3, 5), tool_latency_s=0.001)
    backends = [ScriptedEngine(lambda r: [5] * r.sampling.max_new_tokens, token_delay_s=0.001) for _ in range(2)]
    specs = episode_specs(env.tasks(4, 0), 4, SamplingParams(temperature=0), seed=0)
    async with RoutedEngine(backends, names=["a", "b"]) as engine:
        trajs = await run_rollout(env, engine, ChatRenderer(tokenizer), specs, PlacingPolicy())
    assert len(trajs) == 16 and all(t.error is None for t in trajs)
    for i, backend in enumerate(backends):
        assert len(backend.requests) == 8 * 2 and all(r.kv_pool == i for r in backend.requests)
        assert {int(r.rid.split(".t")[0].rsplit(".s", 1)[1]) % 2 for r in backend.requests} == {i}
