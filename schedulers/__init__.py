"""Scheduling policies (installed as ``rollopt.schedulers``), a registry, and ``build_scheduler``.

``build_scheduler("overlap+prefix+preempt")`` combines policies by name; ``kv[idle_fill=0,min_decoding=0]`` gives
one part constructor options (values parsed as TOML: numbers, booleans, quoted strings; a bare word is a string).
Each policy is one short class in its own module, declares its risk class, and is registered in ``SCHEDULERS``; a
user's policy registers with ``register_scheduler`` and needs no core edits.

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
import re
from typing import Any, Callable

from rollopt.config import parse_value
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


def _split_outside_brackets(text: str, separator: str) -> list[str]:
    """``text`` split at each ``separator`` that is not inside ``[...]``, stripped, empty pieces dropped."""
    pieces, depth, current = [], 0, ""
    for char in text:
        depth += (char == "[") - (char == "]")
        if char == separator and depth == 0:
            pieces.append(current)
            current = ""
        else:
            current += char
    return [piece.strip() for piece in [*pieces, current] if piece.strip()]


def split_specs(text: str) -> tuple[str, ...]:
    """Policy specs separated by commas outside brackets: ``"async,kv[fill=0.8,pause=never]"`` gives
    ``("async", "kv[fill=0.8,pause=never]")`` (``rollopt bench --schedulers``)."""
    return tuple(_split_outside_brackets(text, ","))


_PART = re.compile(r"^([^\[\]+,=\s]+)(?:\[([^\[\]]*)\])?$")


def parse_spec(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"overlap+kv[idle_fill=0,min_decoding=0]"`` as ``[("overlap", {}), ("kv", {"idle_fill": 0, ...})]``
    (values by :func:`rollopt.config.parse_value`; options are split at commas, so a value holds none)."""
    parsed = []
    for text in _split_outside_brackets(spec, "+"):
        match = _PART.match(text)
        if match is None:
            raise ConfigError(f"scheduler {spec!r}: {text!r} is not NAME or NAME[key=value,...] "
                              "(e.g. kv[idle_fill=0,min_decoding=0])")
        options: dict[str, Any] = {}
        for pair in (p.strip() for p in (match.group(2) or "").split(",") if p.strip()):
            key, sep, raw = pair.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"scheduler {spec!r}: option {pair!r} is not key=value")
            options[key.strip()] = parse_value(raw.strip())
        parsed.append((match.group(1), options))
    return parsed


def build_scheduler(spec: str, **options: Any) -> Policy:
    """Build ``"a+b+c"``, each part with the options in its brackets (``"kv[fill=0.8]"``). ``options`` are passed
    to the parts whose constructor accepts them (e.g. ``max_carry_age=2`` for ``preempt``). An option no part
    accepts, or a value a part refuses, is a :class:`ConfigError` that names the part."""
    parsed = parse_spec(spec)
    names = [n for n, _ in parsed]
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
    for n, own in parsed:
        factory = SCHEDULERS[n]
        parameters = inspect.signature(factory).parameters
        if unknown_own := sorted(set(own) - set(parameters)):
            raise ConfigError(f"scheduler {n!r} has no option {unknown_own}; it takes {sorted(parameters) or 'none'}")
        accepted = {k: v for k, v in options.items() if k in parameters}
        used |= set(accepted)
        try:
            parts.append(factory(**{**accepted, **own}))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"scheduler {n!r}: {exc}") from None
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
    "WarmPolicy", "build_scheduler", "parse_spec", "register_scheduler", "split_specs",
]
