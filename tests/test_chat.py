"""The prefix invariant with a real HF tokenizer and chat template: building a conversation by appending
observation deltas gives exactly the tokens of rendering the whole conversation at once."""

import copy

import pytest

from rollopt import ChatRenderer, ConfigError

TOOLS = [{"type": "function", "function": {"name": "calculate", "description": "math", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def test_incremental_tokens_equal_full_render_over_turns(tokenizer):
    r = ChatRenderer(tokenizer)
    messages = [{"role": "system", "content": "Be careful."}, {"role": "user", "content": "What is 17 * 23 - 5?"}]
    assistant_turns = [
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 * 23"}}\n</tool_call>',
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "391 - 5"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + 1"}}\n</tool_call>',
        "<answer>386</answer>",
    ]
    observations = [[{"role": "tool", "content": "391"}],
                    [{"role": "tool", "content": "386"}, {"role": "tool", "content": "2"}]]
    tokens = r.prompt(messages, TOOLS)
    history = copy.deepcopy(messages)
    prompts = [list(tokens)]
    for k, text in enumerate(assistant_turns):
        generated = r.encode(text) + [r.end_of_turn_id]  # what a model emits: the text, then end-of-turn
        tokens += generated
        history.append({"role": "assistant", "content": text})
        if k < len(observations):
            tokens += r.observation(observations[k], generated[-1])
            history += observations[k]
            prompts.append(list(tokens))
            full = r.encode(tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False,
                                                          add_generation_prompt=True))
            assert tokens == full, f"drift after turn {k}"
    for earlier, later in zip(prompts, prompts[1:]):
        assert later[: len(earlier)] == earlier


ENCODE_PROBES = ["", "plain words", "  leading and trailing  ", "tabs\tand\nnewlines\n\n", "<|im_end|>\n<|im_start|>user",
                 "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "unicode: é ü 中文 🙂", "<|im_start|><|im_start|>x"]


def test_encode_and_decode_give_the_tokenizers_own_results(tokenizer):
    """The renderer calls the fast backend directly when that is equivalent; it must match transformers."""
    r = ChatRenderer(tokenizer)
    assert r._backend is not None and r._decoder is not None  # the fast paths are what this test checks
    for text in ENCODE_PROBES:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        assert r.encode(text) == ids, text
        assert r.decode(ids) == tokenizer.decode(ids, skip_special_tokens=False), text


def test_cut_turn_gets_end_of_turn_as_observation(tokenizer):
    r = ChatRenderer(tokenizer)
    delta = r.observation([{"role": "tool", "content": "5"}], last_generated_id=17)
    assert delta[0] == r.end_of_turn_id
    assert r.observation([{"role": "tool", "content": "5"}], r.end_of_turn_id)[0] != r.end_of_turn_id


def test_template_without_tools_gets_them_in_the_system_message(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    r = ChatRenderer(plain)
    text = plain.decode(r.prompt([{"role": "user", "content": "hi"}], TOOLS))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "calculate"' in text


def test_renderer_refuses_tokenizer_without_template(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="chat_template"):
        ChatRenderer(plain)
