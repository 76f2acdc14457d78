"""Chat-template rendering that keeps the token-in/token-out prefix invariant.

The initial prompt is rendered once with the tokenizer's chat template. After that, history is never
re-tokenized: each observation (tool results, user feedback) is rendered as the *delta* the template adds
after an assistant turn, and appended to the trajectory's tokens. So turn k's prompt+response is a bit-exact
prefix of turn k+1's prompt by construction, and the delta is exactly what the template would have rendered
for the whole conversation (tests check both).

How the delta is found: render a fixed stand-in conversation that ends with an assistant message, and the
same conversation plus the new messages and the generation prompt. The second text must extend the first
(else the template is not append-only and :class:`~rollopt.errors.ConfigError` is raised). The delta is the
text after the stand-in assistant's end-of-turn token, tokenized on its own; it starts right after a special
token, which is always a token boundary.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from rollopt.errors import ConfigError
from rollopt.step import Message

_STAND_IN: list[Message] = [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]


def with_tools_in_system(messages: Sequence[Message], tools: Sequence[dict]) -> list[Message]:
    """Describe ``tools`` Hermes-style in the system message (added if there is none)."""
    block = ("# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>\n"
             + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\n\nFor each call, return a JSON object "
             'inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
             "<args-json-object>}\n</tool_call>")
    out = [dict(m) for m in messages]
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return out  # type: ignore[return-value]


def _plain_backend(tokenizer: Any) -> Any:
    """The ``tokenizers`` backend of a fast tokenizer when calling it directly gives what
    ``tokenizer.encode(text, add_special_tokens=False)`` gives (no truncation or padding configured, special
    tokens not split), else None. It skips ~20 µs of Python per call, which the executor pays per observation."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return None
    if bool(getattr(tokenizer, "split_special_tokens", False)) != bool(getattr(backend, "encode_special_tokens", False)):
        return None
    return backend


class ChatRenderer:
    """Renders prompts and observation deltas for one HF tokenizer with a chat template.

    Args:
        tokenizer: a ``transformers`` tokenizer with ``chat_template`` set.
        end_of_turn_token: the token that ends an assistant turn; defaults to the tokenizer's eos token.
    """

    def __init__(self, tokenizer: Any, end_of_turn_token: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat_template; set tokenizer.chat_template to a Jinja template")
        self.tokenizer = tokenizer
        # Templates that know nothing of tools (SmolLM2's, for one) get the tool list in the system message.
        self.template_renders_tools = "tools" in tokenizer.chat_template
        self.end_of_turn_token = end_of_turn_token or tokenizer.eos_token
        self.end_of_turn_id = int(tokenizer.convert_tokens_to_ids(self.end_of_turn_token))
        self._stand_in_text: str | None = None
        self._backend = _plain_backend(tokenizer)
        # decoding through the backend is what ``tokenizer.decode`` does, less ~4 µs of Python, unless the
        # tokenizer post-processes the text (``clean_up_tokenization_spaces``)
        self._decoder = self._backend if not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None
        self._ids_containing: dict[str, frozenset[int]] = {}

    def _text(self, messages: Sequence[Message], tools: Sequence[dict] | None, generation_prompt: bool) -> str:
        if tools and not self.template_renders_tools:
            messages, tools = with_tools_in_system(messages, tools), None
        return self.tokenizer.apply_chat_template(
            list(messages), tools=list(tools) if tools else None, tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated tokens, without the end-of-turn token."""
        ids = list(token_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids = ids[:-1]
        if self._decoder is not None:
            return self._decoder.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def ids_containing(self, char: str) -> frozenset[int]:
        """Every token id whose vocabulary piece contains ``char`` (a superset of those whose text does, for
        byte-level and byte-fallback vocabularies alike, since an ASCII ``char`` is its own piece or in its
        ``<0xNN>`` name). A streaming parser uses it to skip decoding chunks that cannot complete a tag."""
        if char not in self._ids_containing:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._ids_containing[char] = frozenset(i for i, p in enumerate(pieces) if p is not None and char in p)
        return self._ids_containing[char]

    def prompt(self, messages: Sequence[Message], tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the initial prompt, ending with the assistant generation prompt."""
        return self.encode(self._text(messages, tools, generation_prompt=True))

    def observation(self, messages: Sequence[Message], last_generated_id: int | None) -> list[int]:
        """Token ids to append after an assistant turn: the new messages plus the next generation prompt.

        If the turn did not end with the end-of-turn token (it was cut by a length limit), the end-of-turn
        token is prepended so the context stays well-formed; it is an observation token, not a generated one.
        """
        if self._stand_in_text is None:
            self._stand_in_text = self._text(_STAND_IN, None, generation_prompt=False)
        before = self._stand_in_text
        after = self._text([*_STAND_IN, *messages], None, generation_prompt=True)
        if not after.startswith(before):
            raise ConfigError("the chat template re-renders earlier messages when new ones are added; "
                              "rollopt needs an append-only template (ChatML, Llama-3, Qwen2 are)")
        cut = before.rfind(self.end_of_turn_token)
        if cut < 0:
            raise ConfigError(f"the chat template does not end assistant turns with {self.end_of_turn_token!r}; "
                              "pass end_of_turn_token= to ChatRenderer")
        delta = self.encode(after[cut + len(self.end_of_turn_token):])
        if last_generated_id != self.end_of_turn_id:
            delta = [self.end_of_turn_id, *delta]
        return delta
