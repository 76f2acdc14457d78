"""Score a :class:`~rollopt.batch.TrainBatch` with a trainable HF causal LM: per-token log-probabilities of the
tokens in the batch, and the entropy of each predicted distribution.

Alignment (the batch contract): ``logprobs[:, t]`` is log π(input_ids[t] | input_ids[:t]), taken from the logits
at position t − 1; position 0 has no prediction and is NaN, like every non-generated token's behavior logprob.
Logits are computed in float32. Rows are scored in micro-batches of ``micro_batch`` rows to bound the
``[rows, T, vocab]`` logits; the result does not depend on the split beyond float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollopt.batch import TrainBatch


def _score_rows(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    nan = torch.full((input_ids.shape[0], 1), float("nan"), dtype=picked.dtype)
    entropy = None
    if with_entropy:
        ent = -(logp.exp() * logp).sum(-1)
        entropy = torch.cat([nan, ent], dim=1)
    return torch.cat([nan, picked], dim=1), entropy


def score(model: torch.nn.Module, batch: TrainBatch, rows: slice | None = None, with_entropy: bool = False,
          micro_batch: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs, entropy)`` of ``batch`` (padded layout) rows ``rows``, each ``[rows, T]``; gradients flow
    unless called under ``torch.no_grad()``."""
    if batch.layout != "padded":
        raise ValueError("score() takes the padded layout; collate(..., layout='padded')")
    rows = rows or slice(0, batch.input_ids.shape[0])
    ids, att, pos = batch.input_ids[rows], batch.attention_mask[rows], batch.position_ids[rows]
    step = micro_batch or ids.shape[0]
    parts = [_score_rows(model, ids[i:i + step], att[i:i + step], pos[i:i + step], with_entropy)
             for i in range(0, ids.shape[0], step)]
    logprobs = torch.cat([p[0] for p in parts])
    entropy = torch.cat([p[1] for p in parts]) if with_entropy else None
    return logprobs, entropy
