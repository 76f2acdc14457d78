"""Tiny, offline models for tests, CI and CPU benchmarks: a byte-level BPE tokenizer trained locally with
``tokenizers`` (with a ChatML chat template that renders tools and tool calls Qwen2.5-style) and random-init
Llama/Qwen2 models of any shape. Nothing is downloaded.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each call, return a JSON object inside <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ '\\n' }}<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML with Qwen2.5-style tools: tool results are grouped into one user turn of <tool_response> blocks."""

_CORPUS = [
    "The answer is 42. What is 17 times 23? Let me use the calculator tool.",
    '{"name": "calculate", "arguments": {"expression": "17 * 23"}}',
    "A shop has 12 boxes with 7 apples each. It sells 30 apples. How many apples are left?",
    "Compute the result step by step, then give the final answer as <answer>NUMBER</answer>.",
    "You are a helpful assistant. Use tools when they help. Final answer: 391.",
    string.ascii_letters + string.digits + string.punctuation + " \n\t",
    "user assistant system tool function arguments expression result error",
]


def build_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` (a small built-in one by default), with ChatML."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((corpus or _CORPUS) * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = CHATML_TOOLS_TEMPLATE
    return fast


def build_model(
    vocab_size: int,
    family: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    init_scale: float = 0.02,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> torch.nn.Module:
    """A random-init HF causal LM. ``init_scale`` is the init std: a large one (e.g. 0.3) gives peaked
    logits, so greedy decoding does not hinge on near-ties across numerically different kernels."""
    cls_cfg, cls_model = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    config = cls_cfg(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, initializer_range=init_scale,
        tie_word_embeddings=tie_word_embeddings, eos_token_id=eos_token_id, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = cls_model(config).eval()
    if family == "qwen2":  # HF inits biases to zero; give them values so bias handling is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, init_scale)
    return model


def save_tiny(out_dir: str | Path, vocab_size: int = 512, **model_kwargs) -> Path:
    """Build a tokenizer and a model and save both as an HF directory (safetensors) that the local engine and
    an SGLang server can load."""
    out = Path(out_dir)
    tokenizer = build_tokenizer(vocab_size)
    model = build_model(len(tokenizer), eos_token_id=tokenizer.eos_token_id, **model_kwargs)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
