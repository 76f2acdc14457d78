"""Prefix-affine placement with bounded load: the pure decision logic of
:class:`~rollopt.engines.routed.RoutedEngine` (no I/O, no clock, no randomness).

Affinity key (:func:`affinity_key`): the request's explicit ``affinity`` (the executor sets its GRPO group id,
so every turn of every member of a group shares one key), else a digest of its first ``prefix_tokens`` prompt
tokens (requests that start alike land together; a shared system prompt longer than that makes every such
request one key, which is why the explicit key is preferred).

Placement (:meth:`AffinityRouter.route`), for a key not pinned to a healthy server:

1. rank the healthy servers by rendezvous (highest-random-weight) hashing, ``blake2b(name, key)``: the order is
   a function of the key and the server names only, so any router process with the same servers agrees, and
   losing a server moves only the keys that were on it;
2. take the first server in that order whose in-flight count + 1 is at most ``(1 + ε) · (total + 1) / n``
   (consistent hashing with bounded loads, Mirrokni et al. 2018; ``total`` counts every request in flight,
   ``n`` the healthy servers);
3. if none qualifies (small counts), take the least loaded, ties broken by the rendezvous order.

The key is then *pinned* to that server: every later request with the key goes there while it is healthy,
because that server holds the key's prefix in its cache — unless that server has fallen far behind the others
(**rebalancing**): when its in-flight count exceeds the least loaded healthy server's by more than
``rebalance_abs`` requests *and* by a factor of more than ``rebalance_rel``, the key moves to the least loaded one
and is pinned there (its prefix is prefilled there once). This is sgl-model-gateway's ``cache_aware`` rule (it
routes to the shortest queue instead of the best prefix match while ``max - min > balance_abs_threshold`` and
``max > balance_rel_threshold · min``). Balance at placement alone was not enough for agents: a group's
difficulty is shared by its members, so the groups placed evenly by count grew unevenly, and on 8 simulated
H200s at 2,048 software-engineering agents one server prefilled 19.3M tokens and was busy 873 s while another
prefilled 3.8M in 370 s (the same task subset alone on one server thrashes the same way: it is load, not a
policy); with rebalancing every server prefilled 13.0–14.3M and was busy 584–644 s, and ``auto``'s step fell
from 971.8 s to 736.3 s (measured, one run each).

A request the caller has placed (``GenerateRequest.kv_pool``: a policy that sizes each server's KV itself, like
``kv`` behind a router) goes to that server while it is healthy, and its key is pinned there; it is never moved for
load (the caller balances).

Invariants: ``in_flight[i]`` is the number of :meth:`route` results for server ``i`` not yet given back with
:meth:`release`; an unhealthy server is never returned; marking a server unhealthy drops its pins (its keys are
placed afresh on their next request); :meth:`forget_pins` drops them all. Pins are kept for the ``max_keys`` most
recently routed keys.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

from rollopt.engines.base import GenerateRequest
from rollopt.errors import ConfigError, EngineError


class NoHealthyServer(EngineError):
    """Every server behind the router is marked unhealthy."""


def affinity_key(request: GenerateRequest, prefix_tokens: int) -> str:
    """The routing key of ``request``; see the module docstring."""
    if request.affinity is not None:
        return "key:" + request.affinity
    head = request.input_ids[:prefix_tokens]
    digest = hashlib.blake2b(b",".join(str(t).encode() for t in head), digest_size=16).hexdigest()
    return "tokens:" + digest


def rendezvous_weight(name: str, key: str) -> bytes:
    return hashlib.blake2b(f"{name}\x00{key}".encode(), digest_size=8).digest()


class AffinityRouter:
    """Which server each request goes to; see the module docstring.

    Args:
        names: one distinct name per server (their rendezvous identities; e.g. the base URLs).
        epsilon: the load bound's slack ε ≥ 0 (0: strict balance at placement; larger: keys stay on their
            rendezvous-preferred server more often).
        max_keys: how many key pins to remember (least recently routed are forgotten first).
        rebalance_abs, rebalance_rel: a pinned key moves off its server when that server's in-flight count exceeds
            the least loaded one's by more than ``rebalance_abs`` and more than ``rebalance_rel`` times it (None:
            pins never move for load).
    """

    def __init__(self, names: Sequence[str], epsilon: float = 0.1, max_keys: int = 65536,
                 rebalance_abs: int | None = 16, rebalance_rel: float = 1.25) -> None:
        if not names:
            raise ConfigError("AffinityRouter needs at least one server")
        if len(set(names)) != len(names):
            raise ConfigError(f"server names must be distinct, got {list(names)}")
        if epsilon < 0:
            raise ConfigError(f"epsilon must be >= 0, got {epsilon}")
        if max_keys < 1:
            raise ConfigError(f"max_keys must be >= 1, got {max_keys}")
        if (rebalance_abs is not None and rebalance_abs < 0) or rebalance_rel < 1:
            raise ConfigError(f"rebalance_abs must be >= 0 (or None) and rebalance_rel >= 1, got {rebalance_abs} "
                              f"and {rebalance_rel}")
        self.names = tuple(names)
        self.epsilon = epsilon
        self.max_keys = max_keys
        self.rebalance_abs, self.rebalance_rel = rebalance_abs, rebalance_rel
        self.in_flight = [0] * len(names)
        self.healthy = [True] * len(names)
        self.moves = 0  # pinned keys moved off an overloaded server (rebalancing)
        self._pins: OrderedDict[str, int] = OrderedDict()

    def route(self, key: str, server: int | None = None) -> int:
        """The server for one request with ``key``; counts it in flight until :meth:`release`. ``server``: the
        caller's placement (``GenerateRequest.kv_pool``), taken while that server is healthy and pinned for the key
        (no rebalancing: the caller balances)."""
        index = self._pins.get(key)
        if server is not None and 0 <= server < len(self.names) and self.healthy[server]:
            index = server
        elif index is None or not self.healthy[index]:
            index = self._place(key)
        elif (lightest := self._lighter_by_far(index)) is not None:
            index = lightest
            self.moves += 1
        self._pins[key] = index
        self._pins.move_to_end(key)
        while len(self._pins) > self.max_keys:
            self._pins.popitem(last=False)
        self.in_flight[index] += 1
        return index

    def release(self, index: int) -> None:
        if self.in_flight[index] <= 0:
            raise RuntimeError(f"release({index}) without a matching route()")
        self.in_flight[index] -= 1

    def mark_unhealthy(self, index: int) -> None:
        self.healthy[index] = False
        for key in [k for k, i in self._pins.items() if i == index]:
            del self._pins[key]

    def forget_pins(self) -> None:
        """Drop every key pin (the servers' caches were flushed: a pin no longer points at a cached prefix), so
        the next request of each key is placed afresh by the current loads."""
        self._pins.clear()

    def pinned(self, key: str) -> int | None:
        """The server ``key`` is pinned to, if any."""
        return self._pins.get(key)

    def preference(self, key: str) -> list[int]:
        """Healthy servers in rendezvous order for ``key`` (most preferred first)."""
        live = [i for i, ok in enumerate(self.healthy) if ok]
        return sorted(live, key=lambda i: rendezvous_weight(self.names[i], key), reverse=True)

    def _lighter_by_far(self, index: int) -> int | None:
        """The least loaded healthy server if ``index`` is overloaded against it beyond both thresholds."""
        if self.rebalance_abs is None:
            return None
        lightest = min((i for i, ok in enumerate(self.healthy) if ok), key=lambda i: self.in_flight[i])
        low, high = self.in_flight[lightest], self.in_flight[index]
        return lightest if high - low > self.rebalance_abs and high > self.rebalance_rel * low else None

    def _place(self, key: str) -> int:
        order = self.preference(key)
        if not order:
            raise NoHealthyServer(f"no healthy server left among {list(self.names)}")
        total = sum(self.in_flight[i] for i in order)
        bound = (1 + self.epsilon) * (total + 1) / len(order)
        for i in order:
            if self.in_flight[i] + 1 <= bound:
                return i
        return min(order, key=lambda i: self.in_flight[i])  # stable: ties keep the rendezvous order
