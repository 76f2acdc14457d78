"""The one place a configuration becomes running parts: ``(env, engine, policy, renderer)``.

:func:`check_session` resolves every name (environment and its options, scheduler, engine) without loading a
model, so a typo is a one-line :class:`~rollopt.errors.ConfigError` before anything expensive.
:func:`build_session_environment` builds the environment, :func:`start_session` starts the engine for a model and
pairs it with an environment, a policy and a renderer, and :func:`open_session` does all of it (loading the model
unless given) and also enters and leaves the environment. The CLI's ``rollout`` goes through :func:`open_session`;
the trainer (which warm-starts on its environment before its engine starts, and passes the weights it trains)
and ``validate`` (a fresh engine per check, on the environment and policy under test) build their environment
here and go through :func:`start_session`.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from rollopt.config import LocalEngineConfig


@dataclass(frozen=True)
class SessionConfig:
    """What a rollout session is made of."""

    model: str = "tiny"
    """``"tiny"`` (random-init, built in code), ``"smollm2"`` or an HF model directory."""
    environment: str = "calculator"
    """A registered name, an entry point, ``pkg.module:Class`` or ``path/to/file.py:Class``."""
    environment_options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment class (checked against its signature)."""
    engine: Any = field(default_factory=LocalEngineConfig)
    """An engine configuration (:mod:`rollopt.config`; a plug-in engine's own class)."""
    scheduler: str = "overlap+prefix"
    """A policy name, ``+``-combined (``rollopt.schedulers.build_scheduler``)."""
    seed: int = 0
    """Seeds the random-init model."""


@dataclass
class Session:
    """A started session's parts; ``model`` is what the engine was started with."""

    env: Any
    engine: Any
    policy: Any
    renderer: Any
    model: Any


def check_session(config: SessionConfig) -> None:
    """Resolve every name of ``config``; raise a one-line ConfigError on the first bad one. Loads no model."""
    from rollopt.engines import ENGINES
    from rollopt.environments import check_environment_options
    from rollopt.errors import ConfigError
    from rollopt.schedulers import build_scheduler

    check_environment_options(config.environment, dict(config.environment_options))
    build_scheduler(config.scheduler)
    if getattr(config.engine, "kind", None) not in ENGINES:
        raise ConfigError(f"unknown engine {getattr(config.engine, 'kind', config.engine)!r}; registered: "
                          f"{sorted(ENGINES)}")


def build_session_environment(config: SessionConfig) -> Any:
    """A new instance of ``config``'s environment (name and options checked first); not entered."""
    from rollopt.environments import build_environment

    return build_environment(config.environment, **config.environment_options)


@asynccontextmanager
async def start_session(engine: Any, env: Any, model: Any, policy: Any, context: Any = None) -> AsyncIterator[Session]:
    """Start the engine configuration ``engine`` (:func:`rollopt.engines.build_engine`) for ``model`` (a
    :class:`rollopt.modeling.LoadedModel`) and yield it with ``env``, ``policy`` (a built policy, or a name that
    :func:`rollopt.schedulers.build_scheduler` builds) and a renderer of the model's tokenizer; stop the engine on
    exit. ``env`` stays the caller's: this neither enters nor leaves it."""
    from rollopt.chat import ChatRenderer
    from rollopt.engines import build_engine
    from rollopt.schedulers import build_scheduler

    policy = build_scheduler(policy) if isinstance(policy, str) else policy
    async with build_engine(engine, model, context) as started:
        yield Session(env, started, policy, ChatRenderer(model.tokenizer), model)


@asynccontextmanager
async def open_session(config: SessionConfig, model: Any = None, context: Any = None) -> AsyncIterator[Session]:
    """Check ``config``, build its environment, load the model (unless given: a
    :class:`rollopt.modeling.LoadedModel`), start the engine and enter the environment, yield the parts, and
    leave the environment and stop the engine on exit."""
    from rollopt.modeling import load_model

    check_session(config)
    env = build_session_environment(config)
    model = model or load_model(config.model, seed=config.seed)
    async with start_session(config.engine, env, model, config.scheduler, context) as session, env:
        yield session


@dataclass
class RolloutOutcome:
    trajectories: list
    wall_s: float
    engine_stats: Any
    model_name: str
    tokenizer: Any


async def rollout(config: SessionConfig, tasks: int, group_size: int, sampling: Any, seed: int = 0,
                  model: Any = None) -> RolloutOutcome:
    """Roll out ``tasks`` × ``group_size`` episodes of the configured environment (``rollopt rollout``)."""
    from rollopt.episodes import episode_specs
    from rollopt.executor import run_rollout

    async with open_session(config, model) as s:
        specs = episode_specs(s.env.tasks(tasks, seed), group_size, sampling, seed)
        started = time.perf_counter()
        trajectories = await run_rollout(s.env, s.engine, s.renderer, specs, s.policy)
        return RolloutOutcome(trajectories, time.perf_counter() - started, getattr(s.engine, "stats", None),
                              s.model.name, s.model.tokenizer)
