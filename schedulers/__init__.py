"""Scheduling policies (installed as ``rollopt.schedulers``), a registry, and ``build_scheduler``.

``build_scheduler("overlap+prefix+preempt")`` combines policies by name. Each policy is one short class in
its own module, declares its risk class, and is registered in ``SCHEDULERS``; a user's policy registers with
``register_scheduler`` and needs no core edits.

| name      | what it does                                                        | risk |
|-----------|---------------------------------------------------------------------|------|
| sync      | batch-synchronous turns (the classic multi-turn baseline)            | R1   |
| async     | per-trajectory async; a turn's tools start after it is decoded        | R1   |
| overlap   | per-trajectory async; tools start inside the turn as calls close      | R1   |
| prefix    | prefill shared prefixes once, then fork; cache-affinity priority      | R1   |
| preempt   | abort stragglers at the batch quota, carry them over, resume          | R3   |
| warm      | keep each trajectory's KV cached across its tool calls (a TTL pin)    | R1   |
| las       | least attained service first: short trajectories are not stuck behind long ones | R1 |
| kv        | admit trajectories while the KV in use fits the pool (behind a router, resume started ones so too); pin each across its tool call | R1 |
| auto      | the default to pick: overlap+kv                                       | R1   |
| lpf       | longest predicted first: a probe of each group, then the group whose members ran longest | R1 |
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from rollopt.errors import ConfigError
from rollopt.plugins import entry_point
from rollopt.schedulers.base import (
    CompositePolicy, Policy, RiskClass, RolloutView, Stage, ToolLatencies, TrajectoryView,
)
from rollopt.schedulers.auto import AutoPolicy
from rollopt.schedulers.kv import KVPolicy
from rollopt.schedulers.las import LeastAttainedServicePolicy
from rollopt.schedulers.lpf import LongestPredictedFirstPolicy
from rollopt.schedulers.overlap import OverlapPolicy
from rollopt.schedulers.per_trajectory import AsyncPolicy
from rollopt.schedulers.prefix import PrefixPolicy
from rollopt.schedulers.preempt import PreemptPolicy
from rollopt.schedulers.sync import SyncPolicy
from rollopt.schedulers.warm import WarmPolicy

SCHEDULERS: dict[str, Callable[..., Policy]] = {}
ENTRY_POINT_GROUP = "rollopt.schedulers"
"""Installed packages add policies by name through this entry-point group (``name = "pkg.mod:PolicyClass"``)."""


def register_scheduler(name: str, factory: Callable[..., Policy]) -> None:
    """Register a policy class (or factory) under ``name``; it must declare a risk class."""
    risk = getattr(factory, "risk_class", None)
    if not isinstance(risk, RiskClass):
        raise ConfigError(f"scheduler {name!r} declares no risk class; set risk_class = RiskClass.R1/R2/R3")
    if "+" in name:
        raise ConfigError("scheduler names cannot contain '+' (it combines policies)")
    SCHEDULERS[name] = factory


for _cls in (SyncPolicy, AsyncPolicy, OverlapPolicy, PrefixPolicy, PreemptPolicy, WarmPolicy, LeastAttainedServicePolicy,
             KVPolicy, AutoPolicy, LongestPredictedFirstPolicy):
    register_scheduler(_cls.name, _cls)


def build_scheduler(spec: str, **options: Any) -> Policy:
    """Build ``"a+b+c"``. ``options`` are passed to the parts whose constructor accepts them
    (e.g. ``max_carry_age=2`` for ``preempt``)."""
    names = [n.strip() for n in spec.split("+") if n.strip()]
    for n in names:  # an installed package's policy, by entry point
        if n not in SCHEDULERS and (factory := entry_point(ENTRY_POINT_GROUP, n)) is not None:
            register_scheduler(n, factory)
    unknown = [n for n in names if n not in SCHEDULERS]
    if not names or unknown:
        raise ConfigError(f"unknown scheduler {unknown or spec!r}; known: {sorted(SCHEDULERS)} (combine with '+')")
    if len(set(names)) != len(names):
        raise ConfigError(f"scheduler {spec!r} names a policy twice")
    parts = []
    used: set[str] = set()
    for n in names:
        factory = SCHEDULERS[n]
        accepted = {k: v for k, v in options.items() if k in inspect.signature(factory).parameters}
        used |= set(accepted)
        parts.append(factory(**accepted))
    if set(options) - used:
        raise ConfigError(f"options {sorted(set(options) - used)} are not accepted by any of {names}")
    if any(p.barrier for p in parts) and any(p.name in ("async", "overlap", "auto") for p in parts):
        raise ConfigError("'sync' (a per-turn barrier) cannot be combined with 'async' or 'overlap' (no barrier)")
    if "lpf" in names and {"kv", "auto"} & set(names):
        raise ConfigError(f"{spec!r}: 'lpf' and 'kv' (or 'auto') each decide the order trajectories start; pick one")
    return parts[0] if len(parts) == 1 else CompositePolicy(parts)


__all__ = [
    "ENTRY_POINT_GROUP", "SCHEDULERS", "AsyncPolicy", "AutoPolicy", "CompositePolicy", "KVPolicy", "LeastAttainedServicePolicy", "LongestPredictedFirstPolicy", "OverlapPolicy", "Policy",
    "PrefixPolicy", "PreemptPolicy", "RiskClass", "RolloutView", "Stage", "SyncPolicy", "ToolLatencies", "TrajectoryView",
    "WarmPolicy", "build_scheduler", "register_scheduler",
]
