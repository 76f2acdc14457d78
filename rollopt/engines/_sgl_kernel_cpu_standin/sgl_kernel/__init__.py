"""A pure-torch stand-in for ``sgl_kernel``, for running a real SGLang server on CPU in tests and CI only.

What it is: a module named ``sgl_kernel`` that the SGLang server process imports instead of SGLang's compiled
kernel package. It implements exactly one op, :func:`assign_req_to_token_pool_cpu`, in plain torch.

Why it exists: with ``--device cpu`` and ``SGLANG_USE_CPU_ENGINE=1``, ``sglang==0.5.23`` imports ``sgl_kernel``
unconditionally, but no PyPI wheel or sdist carries SGLang's CPU kernels (the ``sgl-kernel`` /
``sglang-kernel`` wheels are CUDA-only and fail with ``libcuda.so.1``); they are only built from an SGLang
source checkout. On the torch-native CPU path for a Llama model (torch_native attention, pytorch sampling,
native RMSNorm/SiLU/RoPE) the only op the server calls is ``assign_req_to_token_pool_cpu``
(``sglang/srt/mem_cache/allocation.py``).

SGLang 0.5.23 also imports these names at module level, so they must exist for the server to start, but the
plain-Llama CPU path never calls them; each is a function that raises ``NotImplementedError`` naming itself:

* ``copy_all_layer_kv_cache_cpu`` (``sglang/kernels/ops/kvcache/cache_move.py``)
* ``build_tree_kernel_efficient_cpu``, ``verify_tree_greedy_cpu`` (``sglang/kernels/ops/speculative/spec_tree.py``)
* ``fill_accept_out_cache_loc_cpu``, ``fill_bonus_tokens_cpu`` (``sglang/kernels/ops/speculative/eagle.py``)
* ``assign_draft_cache_locs_contiguous_cpu``, ``assign_extend_cache_locs_cpu``
  (``sglang/kernels/ops/speculative/cache_locs.py``)

Any other attribute raises ``AttributeError`` naming the missing op.

This depends on sglang 0.5.23's internal import sites and call signature: it is pinned to ``sglang==0.5.23``
and is not a general replacement for ``sgl_kernel``. ``rollopt.engines.sglang_server.SGLangServer`` puts the
parent folder on ``PYTHONPATH`` for the server process only; nothing in rollopt imports it.
"""

from __future__ import annotations

import torch

SGLANG_VERSION = "0.5.23"

IMPORTED_NOT_CALLED = (
    "copy_all_layer_kv_cache_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
)

__all__ = ["assign_req_to_token_pool_cpu", *IMPORTED_NOT_CALLED]


def _missing(name: str, detail: str) -> str:
    return (f"sgl_kernel.{name} is not available: this is rollopt's test/CI-only pure-torch stand-in for "
            f"sgl_kernel (rollopt/engines/_sgl_kernel_cpu_standin), which implements only "
            f"assign_req_to_token_pool_cpu for sglang=={SGLANG_VERSION} on CPU; {detail}. The SGLang code path "
            f"that needs op {name!r} requires SGLang's real CPU kernels, built from an SGLang source checkout.")


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request row ``r`` with range ``[start, end)``, write the next ``end - start`` entries of
    ``out_cache_loc`` into ``req_to_token[req_pool_indices[r], start:end]``, consuming ``out_cache_loc`` in order
    across rows: the semantics of SGLang's triton kernel ``assign_req_to_token_pool``
    (``sglang/srt/mem_cache/allocation.py``). ``pool_len`` is ``req_to_token.shape[1]``."""
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len={pool_len} but req_to_token has {req_to_token.shape[1]} columns")
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
            offset += n


def _imported_not_called(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(_missing(name, "SGLang imports this name at module level, but it is not "
                                                 "implemented here"))
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Not implemented: calling it raises NotImplementedError naming {name!r}."
    return op


for _name in IMPORTED_NOT_CALLED:
    globals()[_name] = _imported_not_called(_name)
del _name


def __getattr__(name: str):
    raise AttributeError(_missing(name, "no other op is provided") if not name.startswith("__") else name)
