"""A block-hashed prefix cache of KV for the embedded engine.

A sequence is cut into blocks of ``block_size`` tokens; block ``j`` is keyed by a hash chained over its
parent's hash and its own tokens, so equal keys mean equal prefixes (each block keeps its tokens and its
parent, and both are compared, so a hash collision cannot return wrong KV). A block holds a copy of its KV
(``[layers, kv_heads, block, dim]``).

Reference counts: a block is referenced by each cached child block; only unreferenced
blocks (leaves) are evicted, least recently used first, so a cached prefix never loses its middle. The cache
holds at most ``capacity_tokens`` tokens. ``clear()`` drops everything (after a weight update: KV computed by
old weights must not be reused).

Pins (KV kept warm across a tool call): ``pin(tokens, valid, until)`` protects the chain of ``tokens[:valid]``
from eviction until the time ``until`` (the deepest block is held; its ancestors are held by their refs).
A pin ends at its deadline or when a lookup reuses the pinned block (the request that continues the
trajectory has taken the KV), whichever comes first. Pins never make the cache exceed its capacity: an insert
that finds only pinned or referenced blocks stops caching, as it does when every block is referenced.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch


@dataclass
class _Block:
    hash: int
    tokens: tuple[int, ...]  # this block's tokens only
    parent: "_Block | None"
    k: torch.Tensor
    v: torch.Tensor
    refs: int = 0
    last_used: int = 0
    pinned_until: float = float("-inf")


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    cleared: int = 0
    blocks: int = field(default=0)
    pinned: int = 0  # pins placed
    pin_hits: int = 0  # pinned blocks reused by a later lookup


class PrefixCache:
    def __init__(self, block_size: int, capacity_tokens: int, now: Callable[[], float] = time.monotonic) -> None:
        """``now`` is the clock pins are measured on (injectable for tests)."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.now = now
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._blocks: dict[int, _Block] = {}
        self._clock = 0
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def _get(self, h: int, toks: tuple[int, ...], parent: _Block | None) -> _Block | None:
        block = self._blocks.get(h)
        return block if block is not None and block.tokens == toks and block.parent is parent else None

    def _block_tokens(self, tokens: Sequence[int], j: int) -> tuple[int, ...]:
        return tuple(tokens[j * self.block_size:(j + 1) * self.block_size])

    def lookup(self, tokens: Sequence[int], max_tokens: int) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """Longest cached prefix of ``tokens`` no longer than ``max_tokens``: ``(n, k, v)`` with KV
        ``[layers, kv_heads, n, dim]`` (``None`` when ``n == 0``). Releases the pins of the blocks it reuses."""
        self.stats.lookups += 1
        self._clock += 1
        found = self._cached_chain(tokens, max_tokens)
        for block in found:
            block.last_used = self._clock
            if block.pinned_until > float("-inf"):
                block.pinned_until = float("-inf")
                self.stats.pin_hits += 1
        if not found:
            return 0, None, None
        n = len(found) * self.block_size
        self.stats.hit_tokens += n
        return n, torch.cat([b.k for b in found], 2), torch.cat([b.v for b in found], 2)

    def cached_tokens(self, tokens: Sequence[int], max_tokens: int) -> int:
        """How many tokens :meth:`lookup` would find (whole blocks), without touching LRU order, pins or stats."""
        return len(self._cached_chain(tokens, max_tokens)) * self.block_size

    def insert(self, tokens: Sequence[int], valid: int, read_kv: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Cache every full block of ``tokens[:valid]`` not cached yet; ``read_kv(start, end)`` returns the
        KV of those positions. Returns the number of new blocks."""
        if self.capacity_blocks == 0:
            return 0
        self._clock += 1
        added = 0
        h, parent = 0, None
        for j in range(valid // self.block_size):
            toks = self._block_tokens(tokens, j)
            h = hash((h, toks))
            block = self._get(h, toks, parent)
            if block is None:
                if h in self._blocks:  # a hash collision with another chain: stop caching this sequence here
                    break
                if len(self._blocks) >= self.capacity_blocks and not self._evict_one(protect=parent):
                    break
                k, v = read_kv(j * self.block_size, (j + 1) * self.block_size)
                block = _Block(hash=h, tokens=toks, parent=parent, k=k, v=v)
                self._blocks[h] = block
                if parent is not None:
                    parent.refs += 1
                added += 1
            block.last_used = self._clock
            parent = block
        self.stats.inserted_blocks += added
        self.stats.blocks = len(self._blocks)
        return added

    def pin(self, tokens: Sequence[int], valid: int, until: float) -> int:
        """Hold the cached chain of ``tokens[:valid]`` until time ``until`` (or until a lookup reuses it).
        Returns the number of tokens now pinned (only full blocks already cached can be pinned)."""
        chain = self._cached_chain(tokens, valid)
        if chain:
            chain[-1].pinned_until = max(chain[-1].pinned_until, until)
            self.stats.pinned += 1
        return len(chain) * self.block_size

    def _cached_chain(self, tokens: Sequence[int], max_tokens: int) -> list[_Block]:
        """The cached blocks of the longest block prefix of ``tokens[:max_tokens]``, root first."""
        chain: list[_Block] = []
        h, parent = 0, None
        for j in range(max_tokens // self.block_size):
            toks = self._block_tokens(tokens, j)
            h = hash((h, toks))
            block = self._get(h, toks, parent)
            if block is None:
                break
            chain.append(block)
            parent = block
        return chain

    def _evict_one(self, protect: _Block | None) -> bool:
        now = self.now()
        leaves = [b for b in self._blocks.values() if b.refs == 0 and b is not protect and b.pinned_until <= now]
        if not leaves:
            return False
        victim = min(leaves, key=lambda b: b.last_used)
        del self._blocks[victim.hash]
        if victim.parent is not None:
            victim.parent.refs -= 1
        self.stats.evicted_blocks += 1
        return True

    def clear(self) -> None:
        self._blocks.clear()
        self.stats.cleared += 1
        self.stats.blocks = 0
