"""The embedded engine against HF transformers, and its batching, caching, abort, pause and update semantics."""

import time

import anyio
import pytest
import torch

from conftest import top2_gap
from rollopt import (
    BadRequestError, ConfigError, EngineFailure, FinishReason, GenerateRequest, LocalEngine, LocalEngineConfig,
    SamplingParams,
)
from rollopt.modeling.llama import LlamaModel, SlotKV
from rollopt.modeling.tiny import build_model

GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int = 0, vocab: int = 500) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(3, vocab, (n,), generator=g).tolist())


def engine(model, tokenizer=None, **cfg) -> LocalEngine:
    config = LocalEngineConfig(**{"max_running": 32, "max_context": 512, **cfg})
    return LocalEngine(model.config, model.state_dict(), config, tokenizer=tokenizer)


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen2", True)])
def test_logits_match_hf_forward(tokenizer, family, tied):
    hf = build_model(len(tokenizer), family=family, tie_word_embeddings=tied, init_scale=0.2, seed=4)
    ours = LlamaModel(hf.config, hf.state_dict())
    kv = SlotKV(ours.shape, 2, 256, torch.float32)
    ids = torch.tensor(prompt(60, vocab=len(tokenizer)))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours.prefill(kv, 1, ids[:25], 0)  # chunked prefill into slot 1
    last = ours.prefill(kv, 1, ids[25:59], 25)
    assert (last - ref[58]).abs().max() < 1e-4
    step = ours.decode(kv, torch.tensor([ids[59]]), torch.tensor([59]), torch.tensor([1]))  # slot 1 only
    assert (step[0] - ref[59]).abs().max() < 1e-4


async def test_greedy_tokens_equal_hf_generate(tokenizer, peaked_model):
    ids = prompt(20, seed=1)
    with torch.no_grad():
        hf = peaked_model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                   pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert min(top2_gap(s[0]) for s in hf.scores) > 1e-3  # not near-ties: parity is meaningful
    async with engine(peaked_model) as eng:
        res = await eng.generate(GenerateRequest("a", ids, GREEDY))
    assert res.output_ids == hf.sequences[0, len(ids):].tolist()
    assert res.finish_reason is FinishReason.LENGTH and res.prompt_tokens == 20
    hf_logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(hf.scores, res.output_ids)]
    assert max(abs(a - b) for a, b in zip(res.logprobs, hf_logprobs)) < 1e-4


async def test_greedy_does_not_depend_on_batch_composition(peaked_model):
    target = prompt(30, seed=2)
    async with engine(peaked_model) as eng:
        alone = await eng.generate(GenerateRequest("alone", target, GREEDY))
        results = {}
        async with anyio.create_task_group() as tg:
            for i in range(32):
                ids = target if i == 7 else prompt(10 + 3 * i, seed=100 + i)

                async def run(i=i, ids=ids):
                    await anyio.sleep(0.002 * (i % 5))  # staggered arrivals join the running batch
                    results[i] = await eng.generate(GenerateRequest(f"r{i}", ids, GREEDY))
                tg.start_soon(run)
        assert eng.stats.decode_steps < 32 * GREEDY.max_new_tokens  # they really were batched
    crowded = results[7]
    assert crowded.output_ids == alone.output_ids
    assert crowded.logprobs == alone.logprobs  # bit-identical, not merely within 1e-5


async def test_staggered_arrivals_match_sequential(peaked_model):
    prompts = [prompt(8 + 5 * i, seed=i) for i in range(6)]
    async with engine(peaked_model, prefix_cache_tokens=0) as eng:
        sequential = [await eng.generate(GenerateRequest(f"s{i}", p, GREEDY)) for i, p in enumerate(prompts)]
        concurrent = [None] * 6
        async with anyio.create_task_group() as tg:
            for i, p in enumerate(prompts):
                async def run(i=i, p=p):
                    await anyio.sleep(0.003 * i)
                    concurrent[i] = await eng.generate(GenerateRequest(f"c{i}", p, GREEDY))
                tg.start_soon(run)
    assert [r.output_ids for r in concurrent] == [r.output_ids for r in sequential]


async def test_prefix_cache_hits_and_gives_identical_tokens(peaked_model):
    shared = prompt(100, seed=5)
    async with engine(peaked_model, prefix_cache_tokens=0) as cold:
        uncached = await cold.generate(GenerateRequest("u", shared + (7, 8), GREEDY))
    async with engine(peaked_model, block_size=16) as eng:
        first = await eng.generate(GenerateRequest("a", shared + (9,), GREEDY))
        second = await eng.generate(GenerateRequest("b", shared + (7, 8), GREEDY))
        assert first.cached_tokens == 0 and second.cached_tokens == 96
        computed = eng.stats.prefill_tokens
        # a group of 8 arriving together computes the shared prompt once
        group = await _gather(eng, [GenerateRequest(f"g{i}", prompt(64, seed=9) + (i + 3,), GREEDY) for i in range(8)])
        assert eng.stats.prefill_tokens - computed == 65 + 7 * 1
        assert sorted(r.cached_tokens for r in group) == [0] + [64] * 7
    assert second.output_ids == uncached.output_ids


async def test_keep_warm_pins_a_trajectory_history_against_eviction_until_its_next_turn(peaked_model):
    """A turn's KV survives other traffic during its tool call when pinned; unpinned, LRU evicts it."""
    history = prompt(96, seed=11)
    sampling = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    cached = {}
    for keep_warm_s in (0.0, 60.0):
        # room for 12 blocks: the turn's 7 blocks, then 3 others of 4 blocks each must evict something
        async with engine(peaked_model, block_size=16, prefix_cache_tokens=192) as eng:
            turn = await eng.generate(GenerateRequest("t0", history, sampling, keep_warm_s=keep_warm_s))
            for i in range(3):  # other trajectories' turns while this one runs its tools
                await eng.generate(GenerateRequest(f"other{i}", prompt(64, seed=20 + i), sampling))
            next_turn = history + tuple(turn.output_ids) + (5, 6, 7)
            cached[keep_warm_s] = (await eng.generate(GenerateRequest("t1", next_turn, sampling))).cached_tokens
            pins = eng.prefix_cache.stats
    assert cached[60.0] == 96 + 16 - 16  # every full block of prompt + output (the last token has no KV yet)
    assert cached[0.0] < cached[60.0]
    assert pins.pinned == 1 and pins.pin_hits == 1


def test_a_pin_expires_at_its_deadline_and_is_released_when_reused():
    from rollopt.engines.prefix_cache import PrefixCache

    now = [0.0]
    cache = PrefixCache(block_size=2, capacity_tokens=4, now=lambda: now[0])
    kv = lambda a, b: (torch.zeros(1, 1, b - a, 1), torch.zeros(1, 1, b - a, 1))  # noqa: E731
    cache.insert([1, 2, 3, 4], 4, kv)
    assert cache.pin([1, 2, 3, 4], 4, until=10.0) == 4
    assert cache.insert([7, 8], 2, kv) == 0  # full, and the only leaf is pinned: nothing is evicted
    now[0] = 11.0
    assert cache.insert([7, 8], 2, kv) == 1  # the pin expired: LRU may evict again
    cache.pin([1, 2], 2, until=100.0)
    assert cache.lookup([1, 2, 9], max_tokens=2)[0] == 2  # reused: the pin is released
    assert cache.lookup([7, 8, 9], max_tokens=2)[0] == 2  # now [1, 2] is the least recently used leaf
    assert cache.insert([5, 6], 2, kv) == 1 and cache.lookup([1, 2, 9], 2)[0] == 0  # and, unpinned, evicted


async def test_requests_arriving_during_a_tick_leave_its_queue_alone(peaked_model, monkeypatch):
    """The tick runs in a worker thread while the event loop accepts new requests; the tick's queue must not
    change under it (an append during its priority sort raised 'list modified during sort')."""
    changed = []
    original = LocalEngine._tick

    def slow_tick(self):
        before = list(self._waiting)
        time.sleep(0.01)  # the event loop runs meanwhile: requests arrive now
        changed.append(self._waiting != before)
        original(self)

    monkeypatch.setattr(LocalEngine, "_tick", slow_tick)
    results = [None] * 12
    async with engine(peaked_model) as eng:
        async with anyio.create_task_group() as tg:
            for i in range(12):
                async def run(i=i):
                    results[i] = await eng.generate(GenerateRequest(f"r{i}", prompt(8, seed=i), GREEDY))
                tg.start_soon(run)
                await anyio.sleep(0.004)
    assert len(changed) > 12 and not any(changed)
    assert [len(r.output_ids) for r in results] == [GREEDY.max_new_tokens] * 12


async def _gather(eng, requests):
    out = [None] * len(requests)
    async with anyio.create_task_group() as tg:
        for i, req in enumerate(requests):
            async def run(i=i, req=req):
                out[i] = await eng.generate(req)
            tg.start_soon(run)
    return out


async def test_abort_returns_partial_tokens_that_resume_exactly(peaked_model):
    ids = prompt(12, seed=3)
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    async with engine(peaked_model) as eng:
        full = await eng.generate(GenerateRequest("full", ids, long))
        seen = []
        async for chunk in eng.stream(GenerateRequest("part", ids, long)):
            seen += chunk.token_ids
            if len(seen) >= 10 and chunk.result is None:
                await eng.abort("part")
            if chunk.result is not None:
                partial = chunk.result
        assert partial.finish_reason is FinishReason.ABORT
        assert 10 <= len(partial.output_ids) < 200 and partial.output_ids == seen
        assert partial.output_ids == full.output_ids[: len(partial.output_ids)]
        rest = await eng.generate(GenerateRequest("rest", ids + tuple(partial.output_ids),
                                                  SamplingParams(max_new_tokens=200 - len(partial.output_ids),
                                                                 temperature=0, ignore_eos=True)))
    assert partial.output_ids + rest.output_ids == full.output_ids


async def test_update_weights_tags_tokens_with_their_version(tokenizer, peaked_model):
    """A request in flight across an update is retracted and re-prefills on the new weights: its tokens after
    the switch are exactly what the new weights alone give for its prompt + tokens before (ids and logprobs).
    Before, it decoded on KV the old weights had computed (SGLang's engine already retracted): tokens tagged
    with the new version differed from it, and the trainer's on-policy checks failed at random."""
    other = build_model(len(tokenizer), init_scale=0.5, seed=99).state_dict()
    long = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
    async with engine(peaked_model) as eng:
        chunks = []
        async for chunk in eng.stream(GenerateRequest("x", prompt(16), long)):
            chunks.append(chunk)
            if len(chunks) == 5:
                assert await eng.update_weights(other) == 1
        res = chunks[-1].result
        assert (await eng.info()).version == 1 and eng.stats.retractions == 1
        assert (await eng.info()).max_running == 32  # its slots: the batch rows `lpf` holds its queue by
        assert len(eng.prefix_cache) == 0 or eng.prefix_cache.stats.cleared == 1
        after = await eng.generate(GenerateRequest("y", prompt(16), GREEDY))
        switch = res.versions.index(1)
        fresh = await eng.generate(GenerateRequest("z", prompt(16) + tuple(res.output_ids[:switch]),
                                                   SamplingParams(max_new_tokens=60 - switch, temperature=0,
                                                                  ignore_eos=True)))
    assert set(res.versions[:switch]) == {0} and set(res.versions[switch:]) == {1} and 5 <= switch < 60
    assert after.versions == [1] * len(after.output_ids)
    assert res.output_ids[switch:] == fresh.output_ids
    assert res.logprobs[switch:] == pytest.approx(fresh.logprobs, abs=1e-5)


async def test_pause_retract_resumes_without_losing_tokens(peaked_model):
    ids = prompt(20, seed=8)
    long = SamplingParams(max_new_tokens=80, temperature=0, ignore_eos=True)
    async with engine(peaked_model) as eng:
        ref = await eng.generate(GenerateRequest("ref", ids, long))
        got = []
        async for chunk in eng.stream(GenerateRequest("r", ids, long)):
            got.append(chunk)
            if len(got) == 10:
                await eng.pause("retract")
                assert eng.stats.retractions == 1
                await eng.resume()
        res = got[-1].result
    assert res.finish_reason is FinishReason.LENGTH and res.output_ids == ref.output_ids
    assert sum(len(c.token_ids) for c in got) == 80


async def test_pause_abort_and_in_place(peaked_model):
    long = SamplingParams(max_new_tokens=300, temperature=0, ignore_eos=True)
    async with engine(peaked_model) as eng:
        results = []

        async def run(rid):
            results.append(await eng.generate(GenerateRequest(rid, prompt(10), long)))
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "a")
            tg.start_soon(run, "b")
            while eng.stats.decode_steps < 5:
                await anyio.sleep(0.001)
            await eng.pause("in_place")
            steps = eng.stats.decode_steps
            await anyio.sleep(0.05)
            assert eng.stats.decode_steps == steps  # nothing decodes while paused in place
            await eng.pause("abort")
        assert [r.finish_reason for r in results] == [FinishReason.ABORT] * 2
        assert all(0 < len(r.output_ids) < 300 for r in results)
        await eng.resume()
        assert len((await eng.generate(GenerateRequest("c", prompt(10), GREEDY))).output_ids) == 24


async def test_stop_tokens_stop_strings_and_seeded_sampling(tokenizer, peaked_model):
    async with engine(peaked_model, tokenizer=tokenizer) as eng:
        free = await eng.generate(GenerateRequest("f", prompt(10), GREEDY))
        stop_id = free.output_ids[5]
        first = free.output_ids.index(stop_id)
        stopped = await eng.generate(GenerateRequest("s", prompt(10), SamplingParams(
            max_new_tokens=24, temperature=0, stop_token_ids=(stop_id,))))
        assert stopped.finish_reason is FinishReason.STOP and stopped.output_ids == free.output_ids[: first + 1]
        text = tokenizer.decode(free.output_ids)
        needle = text[len(text) // 2: len(text) // 2 + 2]
        by_string = await eng.generate(GenerateRequest("t", prompt(10), SamplingParams(
            max_new_tokens=24, temperature=0, stop=(needle,))))
        assert by_string.matched_stop == needle and needle in tokenizer.decode(by_string.output_ids)
        assert len(by_string.output_ids) < 24
        sampled = SamplingParams(max_new_tokens=30, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
        a = await eng.generate(GenerateRequest("a", prompt(10), sampled))
        b = await eng.generate(GenerateRequest("b", prompt(10), sampled))
        c = await eng.generate(GenerateRequest("c", prompt(10), SamplingParams(**{**sampled.__dict__, "seed": 99})))
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs and a.output_ids != c.output_ids
    assert all(lp <= 0 for lp in a.logprobs)


@pytest.mark.parametrize("request_, words", [
    (GenerateRequest("e", ()), "empty prompt"),
    (GenerateRequest("l", prompt(500), SamplingParams(max_new_tokens=100)), "exceeds max_context=512"),
    (GenerateRequest("v", (1, 2, 10**6)), "outside the vocabulary"),
    (GenerateRequest("t", (1, 2), SamplingParams(temperature=-1)), "temperature"),
    (GenerateRequest("p", (1, 2), SamplingParams(top_p=0)), "top_p"),
    (GenerateRequest("k", (1, 2), SamplingParams(top_k=0)), "top_k"),
    (GenerateRequest("m", (1, 2), SamplingParams(max_new_tokens=-1)), "max_new_tokens"),
])
async def test_bad_requests_get_typed_errors_and_the_engine_keeps_serving(peaked_model, request_, words):
    async with engine(peaked_model) as eng:
        with pytest.raises(BadRequestError, match=words):
            await eng.generate(request_)
        assert len((await eng.generate(GenerateRequest("ok", prompt(5), GREEDY))).output_ids) == 24


def test_kv_budget_is_checked_with_a_message_that_names_the_fix(peaked_model):
    with pytest.raises(ConfigError, match="lower max_running"):
        engine(peaked_model, max_running=4096, max_context=8192, kv_budget_mb=100)


async def test_engine_threads_apply_to_its_own_worker_thread_only(peaked_model):
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        engine(peaked_model, threads=0)
    before = torch.get_num_threads()
    async with engine(peaked_model) as default, engine(peaked_model, threads=1) as single:
        expected = await default.generate(GenerateRequest("a", prompt(40), GREEDY))
        got = await single.generate(GenerateRequest("a", prompt(40), GREEDY))
    assert got.output_ids == expected.output_ids
    assert torch.get_num_threads() == before  # the caller's (a trainer's) thread pool is untouched


async def test_engine_failure_keeps_partial_tokens(peaked_model, monkeypatch):
    eng = engine(peaked_model)
    real_decode = eng.model.decode
    calls = {"n": 0}

    def failing_decode(*args):
        calls["n"] += 1
        if calls["n"] > 6:
            raise RuntimeError("simulated kernel failure")
        return real_decode(*args)

    monkeypatch.setattr(eng.model, "decode", failing_decode)
    async with eng:
        with pytest.raises(EngineFailure) as info:
            await eng.generate(GenerateRequest("z", prompt(10), GREEDY))
        assert not await eng.health()
    assert info.value.partial.output_ids and len(info.value.partial.output_ids) == 7


async def test_cancelled_caller_frees_its_slot(peaked_model):
    async with engine(peaked_model, max_running=1) as eng:
        with anyio.move_on_after(0.05):
            await eng.generate(GenerateRequest("gone", prompt(10), SamplingParams(max_new_tokens=400, temperature=0,
                                                                                  ignore_eos=True)))
        res = await eng.generate(GenerateRequest("next", prompt(10), GREEDY))
    assert len(res.output_ids) == 24 and eng.stats.requests_aborted == 1


async def test_bf16_engine_tracks_fp32(peaked_model):
    ids = prompt(40, seed=11)
    async with engine(peaked_model) as fp32, engine(peaked_model, dtype="bfloat16") as bf16:
        a = await fp32.generate(GenerateRequest("a", ids, GREEDY))
        b = await bf16.generate(GenerateRequest("b", ids, GREEDY))
    assert bf16.kv.k.dtype == torch.bfloat16
    assert a.output_ids[:4] == b.output_ids[:4]  # peaked logits: the first tokens agree despite bf16 rounding
    assert abs(a.logprobs[0] - b.logprobs[0]) < 0.1


@pytest.mark.parametrize("invariant", [True, False])
async def test_invariant_prefill_makes_a_resumed_prefix_bit_identical_to_its_decode(peaked_model, invariant):
    """A continuation prefilled from prompt + generated tokens (no cache: another engine) gives the very next
    logprobs of the uninterrupted decode, bit for bit, only with invariant_prefill; without it the prefilled KV
    differs in the last bits (different matmul shapes), which is what can flip a near-tie greedy token."""
    ids = prompt(40, seed=5)
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    async with engine(peaked_model, invariant_prefill=invariant, prefix_cache_tokens=0) as eng:
        full = await eng.generate(GenerateRequest("full", ids, params))
    diffs = []
    for k in (3, 11, 17):
        async with engine(peaked_model, invariant_prefill=invariant, prefix_cache_tokens=0) as eng:
            rest = await eng.generate(GenerateRequest("r", ids + tuple(full.output_ids[:k]),
                                                      SamplingParams(max_new_tokens=24 - k, temperature=0,
                                                                     ignore_eos=True)))
        assert rest.output_ids == full.output_ids[k:]
        diffs += [abs(a - b) for a, b in zip(rest.logprobs, full.logprobs[k:])]
    assert (max(diffs) == 0.0) is invariant


def test_sampling_draws_from_the_filtered_distribution_it_reports():
    from scipy.stats import chisquare

    from rollopt.engines.sampling import filtered_logprobs, sample_token

    logits = torch.randn(64, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    probs = filtered_logprobs(logits, params).exp()
    generator = torch.Generator().manual_seed(0)
    draws = [sample_token(logits, params, generator) for _ in range(4000)]
    counts = torch.bincount(torch.tensor([t for t, _ in draws]), minlength=64).double()
    kept = probs > 0
    assert counts[~kept].sum() == 0  # nothing outside top-k / top-p is ever drawn
    assert all(abs(lp - float(probs[t].log())) < 1e-6 for t, lp in draws[:50])  # the logprob of that distribution
    expected = probs[kept].double() / probs[kept].double().sum() * counts.sum()
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3


async def test_stream_tokens_hold_back_all_but_the_first_and_the_watched_tokens(peaked_model):
    """A request that names its ``stream_tokens`` gets fewer chunks and exactly the same tokens."""
    ids = prompt(16, seed=7)

    async def chunks(watched):
        async with engine(peaked_model) as eng:
            return [c async for c in eng.stream(GenerateRequest("s", ids, GREEDY, stream_tokens=watched))]

    every = await chunks(None)
    tokens = [t for c in every for t in c.token_ids]
    assert len(tokens) == 24 and len(every) > 20  # a chunk per engine step
    quiet = await chunks(frozenset())
    assert len(quiet) == 2 and quiet[1].result is not None  # the first token(s) at once, the rest with the result
    assert [t for c in quiet for t in c.token_ids] == tokens and quiet[1].result == every[-1].result
    watched = tokens[9]
    split = await chunks(frozenset({watched}))
    assert [t for c in split for t in c.token_ids] == tokens and split[-1].result == every[-1].result
    later = [i for i, t in enumerate(tokens) if t == watched and i >= len(split[0].token_ids)]
    assert [c.token_ids[-1] for c in split[1:-1]] == [watched] * len(later)  # each watched token is sent at once
