"""The SGLang engine against a REAL sglang==0.5.23 server on CPU (no mock).

One server per session (fixture ``sglang_server``) serves a tiny random-init Llama with peaked logits that the
fixture builds; the crash test starts and kills its own. If the server cannot be started these tests fail (the
fixture raises), they are never skipped: ``make test`` builds ``.venv-sglang`` first (``make sglang-venv``).
Every assertion is on exact token ids, logprobs or versions, never on timing; aborts and crashes are
triggered after a given number of streamed tokens.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from safetensors.torch import load_file

from rollopt import BadRequestError, EngineError, EngineFailure, FinishReason, GenerateRequest, SamplingParams
from rollopt.engines.local import LocalEngine, LocalEngineConfig
from rollopt.engines.sglang import (
    SGLangEngine, _Live, broadcast_weights, encode_rid, init_trainer_weight_group, weight_metadata,
)
from rollopt.engines.sglang_server import STANDIN_PATH, SGLangServer, free_port
from rollopt.modeling.tiny import save_tiny

pytestmark = pytest.mark.sglang

FP32 = ["--dtype", "float32"]  # parity with the fp32 embedded engine; SGLang's "auto" may downcast on CPU
PROMPTS = [(5, 6, 7, 8, 9, 10, 11, 12), (40, 41, 300, 12, 99), (200, 17, 17, 250, 3, 77, 101)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("sglang-tiny"), init_scale=0.5, seed=1)


@pytest.fixture(scope="session")
def other_dir(tmp_path_factory) -> Path:
    """Same shapes, other weights: the target of weight updates."""
    return save_tiny(tmp_path_factory.mktemp("sglang-tiny-other"), init_scale=0.5, seed=2)


@pytest.fixture(scope="session")
def sglang_server(tiny_dir, tmp_path_factory):
    server = SGLangServer(tiny_dir, extra_args=FP32, log_path=tmp_path_factory.mktemp("sglang-log") / "server.log")
    server.start()  # raises EngineError with the log tail if SGLang cannot start: the tests fail, not skip
    yield server
    server.stop()


@asynccontextmanager
async def slowed(server, step_s: float = 0.01):
    """Make every forward step of the server sleep ``step_s`` (SGLang's test endpoint ``/slow_down``), so an
    abort, pause, update or kill sent after a few streamed tokens lands long before the request could finish,
    even on a loaded machine. Reference runs are made outside it, at full speed."""
    async with httpx.AsyncClient(base_url=server.base_url, trust_env=False) as client:
        (await client.post("/slow_down", json={"forward_sleep_time": step_s})).raise_for_status()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await client.post("/slow_down", json={"forward_sleep_time": 0})
                except httpx.HTTPError:
                    pass  # the server is gone (the crash test kills it)


async def stream_until(engine, request, n_tokens, action):
    """Stream ``request``; once at least ``n_tokens`` have arrived, await ``action()`` once. Returns
    (chunks, result)."""
    chunks, done = [], False
    async with aclosing(engine.stream(request)) as stream:
        async for chunk in stream:
            chunks.append(chunk)
            if not done and sum(len(c.token_ids) for c in chunks) >= n_tokens and chunk.result is None:
                done = True
                await action()
            if chunk.result is not None:
                return chunks, chunk.result
    raise AssertionError("stream ended without a result")


# ---------------------------------------------------------------------------------------------- no server
def test_wire_rids_are_prefix_free():
    rids = ["", "a", "a1", "a.1", "1.a", "a$", "a.x.0$", "ab", "r" * 20]
    wires = [encode_rid(r, "0f1e2d3c", n) for r in rids for n in (0, 1, 10, 11)]
    assert len(set(wires)) == len(wires)
    assert not [(a, b) for a in wires for b in wires if a != b and b.startswith(a)]


def test_a_logprob_without_a_token_ends_a_prefill_only_request_but_fails_a_sampling_one():
    """SGLang 0.5.23 at times answers a ``max_new_tokens=0`` request with one logprob and no token (seen once in
    a full test run: both routed servers were marked failed by it). That logprob belongs to no token the caller
    gets, so the request ends normally; for a request that samples, the same mismatch is still an engine failure."""
    engine = SGLangEngine("http://127.0.0.1:1")
    chunk = {"output_ids": [], "meta_info": {"output_token_logprobs": [[-1.5, 7, None]], "weight_version": "0",
                                             "prompt_tokens": 3, "finish_reason": {"type": "length"}}}
    prefill = _Live(GenerateRequest("p", (1, 2, 3), SamplingParams(max_new_tokens=0)), "w0")
    result = engine._on_chunk(prefill, chunk).result
    assert result.output_ids == [] and result.logprobs == [] and result.finish_reason is FinishReason.LENGTH
    sampling = _Live(GenerateRequest("s", (1, 2, 3), SamplingParams(max_new_tokens=4)), "w1")
    with pytest.raises(EngineFailure, match="0 tokens but 1 logprobs"):
        engine._on_chunk(sampling, chunk)


def test_sgl_kernel_standin_op_and_errors():
    import torch

    spec = importlib.util.spec_from_file_location("standin_sgl_kernel", STANDIN_PATH / "sgl_kernel" / "__init__.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    req_to_token = torch.zeros(3, 6, dtype=torch.int32)
    mod.assign_req_to_token_pool_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([4, 2]),
                                     torch.tensor([7, 8, 9, 10, 11]), 6)
    assert req_to_token[2].tolist() == [0, 7, 8, 9, 0, 0] and req_to_token[0].tolist() == [10, 11, 0, 0, 0, 0]
    assert req_to_token[1].tolist() == [0] * 6
    with pytest.raises(NotImplementedError, match="copy_all_layer_kv_cache_cpu"):
        mod.copy_all_layer_kv_cache_cpu()
    with pytest.raises(AttributeError, match="fused_moe_cpu"):
        mod.fused_moe_cpu


def test_launcher_reports_a_server_that_dies_at_start(tiny_dir, tmp_path):
    server = SGLangServer(tiny_dir, python=sys.executable, log_path=tmp_path / "server.log")  # no sglang here
    with pytest.raises(EngineError, match="No module named 'sglang'") as info:
        server.start()
    assert "exited with code 1" in str(info.value) and not server.running


# ---------------------------------------------------------------------------------------------- real server
def test_free_port_is_outside_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(1024 < p < min(low, 22000) for p in ports) and len(ports) > 1


async def test_a_taken_port_is_replaced_by_a_relaunch_or_named_when_explicit(tiny_dir, tmp_path, monkeypatch):
    import socket

    from rollopt.engines import sglang_server as launcher

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        explicit = SGLangServer(tiny_dir, taken, extra_args=FP32, log_path=tmp_path / "explicit.log")
        with pytest.raises(EngineError, match="could not bind its port"):
            await explicit.astart()
        assert not explicit.running
        picks = iter([taken])  # the launcher's first pick is the squatted port, as in the race
        monkeypatch.setattr(launcher, "free_port", lambda host: next(picks, None) or free_port(host))
        async with SGLangServer(tiny_dir, extra_args=FP32, log_path=tmp_path / "auto.log") as server:
            assert server.port != taken
            async with SGLangEngine(server.base_url) as eng:
                assert (await eng.generate(GenerateRequest("p", PROMPTS[0], greedy(3)))).output_ids
    assert (tmp_path / "auto.log").read_text().count(launcher.BIND_FAILURE) == 1


async def test_generate_with_logprobs(sglang_server):
    async with SGLangEngine(sglang_server.base_url) as eng:
        info = await eng.info()
        assert info.vocab_size == 516 and info.max_context == 2048 and info.eos_token_ids == (2,)
        res = await eng.generate(GenerateRequest("g", PROMPTS[0], greedy(16)))
        assert res.rid == "g" and res.finish_reason is FinishReason.LENGTH and res.prompt_tokens == len(PROMPTS[0])
        assert len(res.output_ids) == len(res.logprobs) == len(res.versions) == 16
        assert all(math.isfinite(lp) and lp <= 0 for lp in res.logprobs)
        assert res.versions == [eng.version] * 16
        assert await eng.health()


async def test_greedy_parity_with_local_engine(sglang_server, tiny_dir):
    local = LocalEngine.from_pretrained(tiny_dir, LocalEngineConfig(max_running=4, max_context=256))
    async with SGLangEngine(sglang_server.base_url) as eng, local:
        for i, ids in enumerate(PROMPTS):
            ours = await local.generate(GenerateRequest(f"l{i}", ids, greedy(24)))
            theirs = await eng.generate(GenerateRequest(f"s{i}", ids, greedy(24)))
            assert theirs.output_ids == ours.output_ids
            assert max(abs(a - b) for a, b in zip(theirs.logprobs, ours.logprobs)) < 1e-3


async def test_stream_chunks_concatenate_to_the_result(sglang_server):
    async with SGLangEngine(sglang_server.base_url) as eng:
        chunks = [c async for c in eng.stream(GenerateRequest("st", PROMPTS[1], greedy(40)))]
        res = chunks[-1].result
        assert res is not None and all(c.result is None for c in chunks[:-1]) and len(chunks) > 1
        assert sum((c.token_ids for c in chunks), []) == res.output_ids
        assert sum((c.logprobs for c in chunks), []) == res.logprobs
        assert sum((c.versions for c in chunks), []) == res.versions
        assert res.output_ids == (await eng.generate(GenerateRequest("st", PROMPTS[1], greedy(40)))).output_ids


async def test_stream_tokens_hold_back_all_but_the_first_and_the_watched_tokens(sglang_server):
    """The client buffers what the request lets it hold back; tokens, logprobs, versions and result are unchanged."""
    async with SGLangEngine(sglang_server.base_url) as eng:
        reference = await eng.generate(GenerateRequest("ref", PROMPTS[1], greedy(40)))
        watched = reference.output_ids[20]
        for tokens in (frozenset(), frozenset({watched})):
            request = GenerateRequest("held", PROMPTS[1], greedy(40), stream_tokens=tokens)
            chunks = [c async for c in eng.stream(request)]
            result = chunks[-1].result
            assert result is not None and result.output_ids == reference.output_ids
            assert result.versions == reference.versions  # logprobs: the cached prefix may differ in rounding
            assert max(abs(a - b) for a, b in zip(result.logprobs, reference.logprobs)) < 1e-3
            assert sum((c.token_ids for c in chunks), []) == result.output_ids
            assert sum((c.logprobs for c in chunks), []) == result.logprobs
            assert sum((c.versions for c in chunks), []) == result.versions
            # after the first chunk, a chunk is sent before the last only when it holds a watched token (the
            # server may pack several tokens in one event, so the watched one need not end the chunk)
            assert all(watched in c.token_ids for c in chunks[1:-1])
            assert len(chunks) <= 2 + reference.output_ids.count(watched) * (watched in tokens)


async def test_abort_keeps_partial_and_resume_completes_identically(sglang_server):
    n = 160
    async with SGLangEngine(sglang_server.base_url) as eng:
        ref = await eng.generate(GenerateRequest("ref", PROMPTS[2], greedy(n)))
        async with slowed(sglang_server):
            chunks, part = await stream_until(eng, GenerateRequest("ab", PROMPTS[2], greedy(n)), 5,
                                              lambda: eng.abort("ab"))
        k = len(part.output_ids)
        assert part.finish_reason is FinishReason.ABORT and 5 <= k < n
        assert part.output_ids == ref.output_ids[:k] == sum((c.token_ids for c in chunks), [])
        assert len(part.logprobs) == len(part.versions) == k and all(math.isfinite(x) for x in part.logprobs)
        resumed = await eng.generate(GenerateRequest("ab", PROMPTS[2] + tuple(part.output_ids), greedy(n - k)))
        assert resumed.finish_reason is FinishReason.LENGTH
        assert part.output_ids + resumed.output_ids == ref.output_ids  # nothing lost, nothing duplicated
        assert part.versions + resumed.versions == [eng.version] * n
        assert resumed.cached_tokens > 0  # the aborted request's KV was kept in the radix cache


async def test_abort_by_rid_does_not_touch_a_rid_it_prefixes(sglang_server):
    async with SGLangEngine(sglang_server.base_url) as eng, slowed(sglang_server):
        async with anyio.create_task_group() as tg:
            results = {}

            async def run_long():
                results["r1"] = await eng.generate(GenerateRequest("r1", PROMPTS[0], greedy(120)))
            tg.start_soon(run_long)
            _, results["r"] = await stream_until(eng, GenerateRequest("r", PROMPTS[1], greedy(600)), 3,
                                                 lambda: eng.abort("r"))
        assert results["r"].finish_reason is FinishReason.ABORT
        assert results["r1"].finish_reason is FinishReason.LENGTH and len(results["r1"].output_ids) == 120


async def test_pause_retract_and_resume_keeps_every_token(sglang_server):
    n = 200
    async with SGLangEngine(sglang_server.base_url) as eng:
        ref = await eng.generate(GenerateRequest("ref", PROMPTS[0], greedy(n)))

        async def pause_then_resume():
            await eng.pause("retract")
            assert await eng.health()  # liveness while paused
            await eng.resume()

        async def pause_in_place_then_resume():
            await eng.pause("in_place")
            await eng.resume()

        async def pause_abort():
            await eng.pause("abort")
        async with slowed(sglang_server):
            _, res = await stream_until(eng, GenerateRequest("p", PROMPTS[0], greedy(n)), 5, pause_then_resume)
            _, kept = await stream_until(eng, GenerateRequest("pi", PROMPTS[0], greedy(n)), 5,
                                         pause_in_place_then_resume)
            _, part = await stream_until(eng, GenerateRequest("pa", PROMPTS[0], greedy(n)), 5, pause_abort)
            await eng.resume()
        assert res.finish_reason is FinishReason.LENGTH and res.output_ids == ref.output_ids
        assert kept.finish_reason is FinishReason.LENGTH and kept.output_ids == ref.output_ids
        assert part.finish_reason is FinishReason.ABORT and part.output_ids == ref.output_ids[:len(part.output_ids)]
        assert (await eng.generate(GenerateRequest("after", PROMPTS[0], greedy(8)))).output_ids == ref.output_ids[:8]


async def test_update_weights_from_disk_and_tensor_change_outputs_and_versions(sglang_server, tiny_dir, other_dir):
    original = load_file(tiny_dir / "model.safetensors")
    req = GenerateRequest("u", PROMPTS[0], greedy(16))
    async with SGLangEngine(sglang_server.base_url) as eng:
        v0 = eng.version
        base = await eng.generate(req)
        try:
            assert await eng.update_weights(str(other_dir)) == v0 + 1 == eng.version
            moved = await eng.generate(req)
            assert moved.output_ids != base.output_ids and moved.versions == [v0 + 1] * 16
            other_local = LocalEngine.from_pretrained(other_dir, LocalEngineConfig(max_running=2, max_context=128))
            async with other_local:
                assert moved.output_ids == (await other_local.generate(req)).output_ids
        finally:
            assert await eng.update_weights(original) == v0 + 2  # from tensor: back to the original weights
        back = await eng.generate(req)
        assert back.output_ids == base.output_ids and back.versions == [v0 + 2] * 16
        assert max(abs(a - b) for a, b in zip(back.logprobs, base.logprobs)) < 1e-4
        assert (await eng.info()).version == v0 + 2
    async with SGLangEngine(sglang_server.base_url) as again:  # a new client reads the server's version
        assert again.version == v0 + 2


async def test_update_mid_request_tags_each_token_with_its_version(sglang_server, tiny_dir, other_dir):
    n = 300
    async with SGLangEngine(sglang_server.base_url) as eng:
        v0 = eng.version
        try:
            async with slowed(sglang_server):
                _, res = await stream_until(eng, GenerateRequest("mid", PROMPTS[1], greedy(n)), 5,
                                            lambda: eng.update_weights(other_dir))
        finally:
            await eng.update_weights(tiny_dir)
        assert res.finish_reason is FinishReason.LENGTH and len(res.versions) == n
        split = res.versions.index(v0 + 1)
        assert split >= 5 and res.versions == [v0] * split + [v0 + 1] * (n - split)


async def test_cached_tokens_for_a_shared_prefix(sglang_server):
    prefix = tuple(range(100, 140))
    async with SGLangEngine(sglang_server.base_url) as eng:
        await eng.flush_cache()
        first = await eng.generate(GenerateRequest("c1", prefix + (7,), greedy(4)))
        second = await eng.generate(GenerateRequest("c2", prefix + (9, 10), greedy(4)))
        assert first.cached_tokens == 0 and 0 < second.cached_tokens <= len(prefix)


async def test_flush_cache_retries_while_busy(sglang_server):
    async with SGLangEngine(sglang_server.base_url, flush_attempts=3, flush_retry_s=0.01) as eng:
        async def flush_while_running():
            with pytest.raises(EngineError, match="flush_cache"):
                await eng.flush_cache()
            await eng.abort("busy")
        async with slowed(sglang_server):
            _, res = await stream_until(eng, GenerateRequest("busy", PROMPTS[0], greedy(1500)), 3,
                                        flush_while_running)
        assert res.finish_reason is FinishReason.ABORT
        await eng.flush_cache()  # idle now


async def test_bad_requests_raise_typed_errors_and_the_server_keeps_serving(sglang_server):
    async with SGLangEngine(sglang_server.base_url) as eng:
        with pytest.raises(BadRequestError, match="outside the vocabulary"):
            await eng.generate(GenerateRequest("b1", (5, 516), greedy(4)))  # would crash sglang 0.5.23 on CPU
        with pytest.raises(BadRequestError, match="context length"):
            await eng.generate(GenerateRequest("b2", (5,) * 2100, greedy(4)))
        with pytest.raises(BadRequestError, match="maximum context length"):
            await eng.generate(GenerateRequest("b3", (5, 6), greedy(4000)))
        with pytest.raises(BadRequestError, match="temperature"):
            await eng.generate(GenerateRequest("b4", (5, 6), SamplingParams(temperature=-1)))
        res = await eng.generate(GenerateRequest("ok", PROMPTS[0], greedy(4)))
        assert res.finish_reason is FinishReason.LENGTH and await eng.health()


async def test_incremental_streaming_server_gives_the_same_chunks_and_result(sglang_server, tiny_dir, tmp_path):
    """A server rollopt starts streams deltas (``--incremental-streaming-output``); SGLang's default resends every
    earlier token and logprob in each chunk. The client reads the flag from /server_info and yields the same tokens
    and logprobs from both."""
    request = GenerateRequest("inc", PROMPTS[2], greedy(40))
    assert "--incremental-streaming-output" in sglang_server.command()
    async with SGLangEngine(sglang_server.base_url) as eng:
        assert eng.incremental_stream
        chunks = [c async for c in eng.stream(request)]
    cumulative = SGLangServer(tiny_dir, extra_args=FP32, log_path=tmp_path / "cumulative.log", incremental_stream=False)
    assert "--incremental-streaming-output" not in cumulative.command()
    assert cumulative.command().count("--max-total-tokens") == 1  # the CPU default, 8192
    larger = SGLangServer(tiny_dir, extra_args=[*FP32, "--max-total-tokens", "16384"]).command()
    at = larger.index("--max-total-tokens")  # a flag given replaces the CPU default instead of following it
    assert larger.count("--max-total-tokens") == 1 and larger[at + 1] == "16384" and "8192" not in larger
    assert "--disable-overlap-schedule" in larger and larger[larger.index("--device") + 1] == "cpu"
    async with cumulative:
        async with SGLangEngine(cumulative.base_url) as eng:
            assert not eng.incremental_stream
            ref_chunks = [c async for c in eng.stream(request)]
    res, ref = chunks[-1].result, ref_chunks[-1].result
    for stream, result in ((chunks, res), (ref_chunks, ref)):
        assert len(stream) > 1 and sum((c.token_ids for c in stream), []) == result.output_ids
        assert sum((c.logprobs for c in stream), []) == result.logprobs
    assert res.output_ids == ref.output_ids and ref.versions == [0] * 40  # a fresh server
    assert len(res.versions) == 40 and len(set(res.versions)) == 1  # the session server's version, whatever it is
    assert max(abs(a - b) for a, b in zip(res.logprobs, ref.logprobs)) < 1e-4


async def test_killed_server_gives_engine_failure_and_a_relaunch_resumes_without_loss(sglang_server, tiny_dir,
                                                                                      tmp_path):
    n = 200
    request = GenerateRequest("k", PROMPTS[1], greedy(n))
    async with SGLangEngine(sglang_server.base_url) as eng:  # the session server has the same (original) weights
        ref = await eng.generate(request)
    first = SGLangServer(tiny_dir, extra_args=FP32, log_path=tmp_path / "first.log")
    async with first, slowed(first):
        async with SGLangEngine(first.base_url) as eng:
            chunks = []
            with pytest.raises(EngineFailure) as failure:
                async for chunk in eng.stream(request):
                    chunks.append(chunk)
                    if sum(len(c.token_ids) for c in chunks) >= 5:
                        first.kill()  # SIGKILL the whole process group mid-request
            part = failure.value.partial
            k = len(part.output_ids)
            assert part.finish_reason is FinishReason.ABORT and 5 <= k < n
            assert part.output_ids == ref.output_ids[:k] == sum((c.token_ids for c in chunks), [])
            assert len(part.logprobs) == len(part.versions) == k
            with pytest.raises(EngineFailure) as down:  # the server is gone: typed, with an empty partial
                await eng.generate(GenerateRequest("k2", PROMPTS[0], greedy(4)))
            assert down.value.partial is not None and down.value.partial.output_ids == []
            assert not await eng.health()
    with pytest.raises(EngineError):
        async with SGLangEngine(first.base_url):
            pass
    async with SGLangServer(tiny_dir, extra_args=FP32, log_path=tmp_path / "second.log") as second:
        async with SGLangEngine(second.base_url) as eng:
            rest = await eng.generate(GenerateRequest("k", PROMPTS[1] + tuple(part.output_ids), greedy(n - k)))
    assert part.output_ids + rest.output_ids == ref.output_ids  # no token lost or duplicated
    assert part.versions + rest.versions == [0] * n


async def test_update_weights_from_distributed_over_gloo(sglang_server, tiny_dir):
    """The trainer (this process, rank 0) broadcasts weights to the server (rank 1) over a gloo group on CPU."""
    import torch.distributed as dist

    original = load_file(tiny_dir / "model.safetensors")
    sharper = {k: v * 1.5 if k == "lm_head.weight" else v for k, v in original.items()}  # same argmax, sharper
    req = GenerateRequest("d", PROMPTS[0], greedy(8))
    async with SGLangEngine(sglang_server.base_url) as eng:
        base = await eng.generate(req)
        port, group = free_port(), {}

        async def trainer_joins():
            group["pg"] = await anyio.to_thread.run_sync(init_trainer_weight_group, "127.0.0.1", port, 2,
                                                          "rollopt-test", "gloo", 60)
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(trainer_joins)
                await eng.init_weights_update_group("127.0.0.1", port, 1, 2, group_name="rollopt-test",
                                                    backend="gloo")
        v0 = eng.version
        try:
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, broadcast_weights, sharper, group["pg"])
                    version = await eng.update_weights_from_distributed(*weight_metadata(sharper),
                                                                        group_name="rollopt-test")
            assert version == v0 + 1
            moved = await eng.generate(req)
            assert moved.output_ids == base.output_ids and moved.versions == [v0 + 1] * 8
            assert all(m > b for m, b in zip(moved.logprobs, base.logprobs))  # the argmax got more likely
        finally:
            await eng.destroy_weights_update_group("rollopt-test")
            dist.destroy_process_group(group["pg"])
            await eng.update_weights(original)
        assert (await eng.generate(req)).output_ids == base.output_ids


async def test_schedulers_on_the_real_server(sglang_server, tiny_dir):
    """The executor and policies against SGLang: R1 parity of sync vs overlap+prefix (and vs the embedded
    engine), and preemption with carry-over that loses no token."""
    from transformers import AutoTokenizer

    from rollopt import ChatRenderer, RolloutExecutor, episode_specs, run_rollout
    from rollopt.environments import SyntheticEnv

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(tiny_dir))
    env = SyntheticEnv(turns=(1, 3), tokens_per_turn=(4, 10), tool_latency_s=0.01)
    specs = episode_specs(env.tasks(3, 0), 2, SamplingParams(temperature=0), seed=0)
    tokens = {}
    async with SGLangEngine(sglang_server.base_url) as eng:
        for policy in ("sync", "overlap+prefix"):
            trajs = await run_rollout(env, eng, renderer, specs, policy)
            tokens[policy] = {t.id: t.token_ids.tolist() for t in trajs}
        long_env = SyntheticEnv(turns=(1, 2), tokens_per_turn=(4, 8), tool_latency_s=0.01, long_tail_fraction=0.5,
                                long_tail_factor=20)
        executor = RolloutExecutor(long_env, eng, renderer, "overlap+preempt")
        first = await executor.run(episode_specs(long_env.tasks(4, 3), 2, SamplingParams(temperature=0), seed=0),
                                   target_groups=2)
        carried = {r.id for r in executor.carry}
        second = await executor.run([])
    local = LocalEngine.from_pretrained(tiny_dir, LocalEngineConfig(max_running=8, max_context=1024))
    async with local:
        ref = {t.id: t.token_ids.tolist() for t in await run_rollout(env, local, renderer, specs, "sync")}
    assert tokens["sync"] == tokens["overlap+prefix"] == ref
    assert len(first.trajectories) == 4 and first.preempted > 0 and carried
    assert {t.id for t in second.trajectories} == carried
    held = sum(t.num_generated for t in first.trajectories + second.trajectories)
    assert held == first.tokens_streamed + second.tokens_streamed  # no token lost or duplicated


async def test_training_on_a_real_sglang_server_syncs_weights_every_step(tmp_path):
    """`rollopt train` with rollout.engine = "sglang": the trainer starts a server for its weights, pushes
    each update with /update_weights_from_tensor, and the next step's tokens carry the new version and
    match the trainer's logprobs (they would not if the server still sampled with the old weights)."""
    import json

    from rollopt.trainer.loop import Trainer
    from rollopt.trainer.recipe import load_recipe

    recipe = load_recipe(None, [
        "environment.name=synthetic", "environment.options.turns=[2, 2]", "environment.options.tokens_per_turn=[6, 10]",
        "environment.options.tool_latency_s=0.01", "environment.options.prompt_words=8", "model.init_scale=0.3",
        "rollout.engine=sglang", "rollout.scheduler=overlap", "rollout.tasks_per_step=2", "rollout.group_size=4",
        "rollout.temperature=0.8", "loop.steps=3", "algorithm.lr=3e-3", "algorithm.micro_batch=8"])
    await Trainer(recipe, tmp_path).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]
    assert all(r["staleness/max"] == 0 and r["grad_norm"] > 0 for r in rows)
    assert all(r["mismatch/lag0/abs_dlogp"] < 1e-3 for r in rows), [r["mismatch/lag0/abs_dlogp"] for r in rows]


async def test_calibrate_reads_the_servers_sizes_and_fits_its_probes(sglang_server):
    """``rollopt calibrate --engine sglang``'s core on the real server: the sizes come from ``/server_info``
    and a fit of a few probes gives non-negative coefficients that price every probe."""
    from rollopt.engines.sim_calibration import Probe, calibrate, engine_sizes

    async with SGLangEngine(sglang_server.base_url) as eng:
        sizes = await engine_sizes(eng, None)
        assert sizes.max_running >= 1 and sizes.prefill_chunk >= 1 and sizes.block_size >= 1
        assert sizes.kv_tokens >= sizes.max_context >= 64
        assert (await eng.info()).kv_tokens == sizes.kv_tokens  # what `kv` admits by on this server
        assert (await eng.info()).max_running == sizes.max_running  # what `lpf` holds its queue by
        assert (await eng._get_server_info())["schedule_policy"] == "fcfs"  # SGLang's default, reported
        assert sizes.defer_shared_prefill is False  # fcfs prefills a prompt shared by requests that come together
        assert sizes.mixed_prefill is False  # no --enable-mixed-chunk: a prefill batch runs alone, decode waits
        probes = [Probe(b, p, n) for b in (1, 4) for p in (16, 48) for n in (4, 12)]
        fit = await calibrate(eng, sizes, "sglang tiny", probes=probes, repeats=1)
    assert min(fit.cost.coefficients) >= 0
    assert [p.probe for p in fit.probes] == probes and all(p.fitted_s > 0 for p in fit.probes)
    assert fit.cost.name.startswith("fitted:sglang tiny (linear, 8 probes")
