"""Token sampling with the logprob of the exact distribution sampled from.

Greedy (``temperature == 0``): argmax, logprob under the raw softmax. Otherwise: logits / temperature, then
top-k, then top-p (smallest set whose mass reaches ``top_p``, always keeping the top token), renormalized;
the token is drawn from that distribution with the request's own ``torch.Generator`` (one uniform draw, inverse
CDF) and its logprob is taken from the same distribution. Rows are independent, so a row's result never depends on the rest of the batch.
"""

from __future__ import annotations

import torch

from rollopt.engines.base import SamplingParams


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities ``[vocab]`` of the distribution ``params`` samples from (``-inf`` where filtered)."""
    if params.temperature == 0:
        return torch.log_softmax(logits, -1)
    scaled = logits / params.temperature
    if params.top_k != -1 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_vals, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_vals, -1)
        mass_before = torch.cumsum(probs, -1) - probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[0] = False
        scaled = scaled.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    return torch.log_softmax(scaled, -1)


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, float]:
    """Sample one token from ``logits`` (``[vocab]``, float32); return ``(token_id, logprob)``."""
    logprobs = filtered_logprobs(logits, params)
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:  # inverse CDF with one uniform draw (several times cheaper than torch.multinomial on one row)
        cdf = torch.cumsum(logprobs.exp().double(), 0)
        u = torch.rand((), generator=generator, dtype=torch.float64)
        token = int(torch.searchsorted(cdf, u * cdf[-1], right=True))  # a filtered token has a zero-width bin
    return token, float(logprobs[token])
