"""Shared fixtures: a locally trained tokenizer and tiny random-init models (nothing is downloaded)."""

from __future__ import annotations

import pytest
import torch

from rollopt.modeling.tiny import build_model, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def peaked_model(tokenizer):
    """A tiny Llama with a large init scale: peaked logits, so greedy decoding has clear winners."""
    return build_model(len(tokenizer), init_scale=0.5, eos_token_id=tokenizer.eos_token_id, seed=1)


@pytest.fixture(scope="session")
def peaked_state(peaked_model):
    return {k: v.clone() for k, v in peaked_model.state_dict().items()}


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits, 2).values
    return float(top[..., 0].min() - top[..., 1].max()) if logits.ndim == 1 else float((top[:, 0] - top[:, 1]).min())
