"""Inference engines behind one async interface (``base.Engine``), and the registry that builds them.

Shipped: ``local`` (the embedded torch engine), ``sglang`` (a real SGLang server started for the weights) and
``servers`` (running SGLang servers behind ``RoutedEngine``); ``scripted`` (``ScriptedEngine``) is for unit
tests of scheduling logic and is not registered. A new engine registers a configuration class (a frozen
dataclass with a ``kind``; see :mod:`rollopt.config`) and an opener, and is then usable from every command and
recipe with no core edit::

    register_engine("mine", MineConfig, open_mine)   # open_mine(config, model, context) -> async CM of Engine
    async with build_engine(MineConfig(...), model) as engine: ...

This module is the one place engines are constructed. It imports no torch: openers import their engine
lazily.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncContextManager, AsyncIterator, Callable

from rollopt.config import LocalEngineConfig, ServersEngineConfig, SGLangEngineConfig, SimEngineConfig
from rollopt.errors import ConfigError


@dataclass(frozen=True)
class EngineContext:
    """What an opener may use besides the configuration and the weights."""

    log_dir: Path | None = None  # where a server writes its log (None: a temporary place)
    progress: Callable[[str], None] = field(default=lambda message: None)  # one-line status messages
    script: Callable[[Any], list[int]] | None = None
    """How an engine that runs no model (the simulated one) decides each request's tokens: ``script(request)``;
    an environment that scripts its agent provides it (``AgentEnv.simulated_model``). Other engines ignore it."""


Opener = Callable[[Any, Any, EngineContext], AsyncContextManager[Any]]
"""``opener(config, model, context)``: an async context manager yielding a started :class:`base.Engine` for a
:class:`rollopt.modeling.LoadedModel` (HF config, state dict, tokenizer, name); it stops the engine on exit."""


@dataclass(frozen=True)
class EngineEntry:
    config: type
    open: Opener


ENGINES: dict[str, EngineEntry] = {}


def register_engine(name: str, config: type, opener: Opener) -> None:
    """Make engine ``name`` buildable; ``config`` is its configuration class (its ``kind`` must be ``name``)."""
    if getattr(config, "kind", None) != name:
        raise ValueError(f"{config.__name__}.kind must be {name!r} to register it as engine {name!r}")
    ENGINES[name] = EngineEntry(config, opener)


def engine_config(name: str, **options: Any) -> Any:
    """The configuration of engine ``name`` from keyword options (e.g. a recipe section); a one-line ConfigError
    for an unknown engine or option."""
    if name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}; registered: {sorted(ENGINES)} (rollopt.engines.register_engine)")
    cls = ENGINES[name].config
    known = {f for f in getattr(cls, "__dataclass_fields__", {})}
    if unknown := sorted(set(options) - known):
        raise ConfigError(f"engine {name!r} has no option(s) {unknown}; known: {sorted(known)}")
    return cls(**options)


def run(fn: Callable[[], Any], config: Any) -> Any:
    """``anyio.run(fn)`` on the clock the engine ``config`` needs: an engine whose configuration says
    ``virtual_clock`` (the simulated one) runs under trio's ``MockClock(autojump_threshold=0)``, so its iterations
    and every tool's ``anyio.sleep`` advance virtual time and cost no wall time; any other runs on asyncio."""
    import anyio

    if getattr(config, "virtual_clock", False):
        from trio.testing import MockClock

        return anyio.run(fn, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)})
    return anyio.run(fn)


def build_engine(config: Any, model: Any, context: EngineContext | None = None) -> AsyncContextManager[Any]:
    """An async context manager that starts the engine ``config`` describes for ``model`` and stops it on exit."""
    kind = getattr(config, "kind", None)
    if kind not in ENGINES:
        raise ConfigError(f"unknown engine {kind!r}; registered: {sorted(ENGINES)} (rollopt.engines.register_engine)")
    return ENGINES[kind].open(config, model, context or EngineContext())


@asynccontextmanager
async def _open_local(config: LocalEngineConfig, model: Any, context: EngineContext) -> AsyncIterator[Any]:
    from rollopt.engines.local import LocalEngine

    async with LocalEngine(model.config, model.state_dict, config, tokenizer=model.tokenizer,
                           model_name=model.name) as engine:
        yield engine


@asynccontextmanager
async def _open_sglang(config: SGLangEngineConfig, model: Any, context: EngineContext) -> AsyncIterator[Any]:
    import tempfile

    from rollopt.engines.sglang import SGLangEngine
    from rollopt.engines.sglang_server import SGLangServer
    from rollopt.modeling.loading import save_hf_dir

    with tempfile.TemporaryDirectory(prefix="rollopt-sglang-") as tmp:
        log = context.log_dir / "sglang.log" if context.log_dir is not None else None
        context.progress("starting an SGLang server")
        async with SGLangServer(save_hf_dir(model, tmp), extra_args=list(config.args), device=config.device,
                                python=config.python, log_path=log,
                                incremental_stream=config.incremental_stream) as server:
            async with SGLangEngine(server.base_url) as engine:
                yield engine


@asynccontextmanager
async def _open_servers(config: ServersEngineConfig, model: Any, context: EngineContext) -> AsyncIterator[Any]:
    from rollopt.engines.routed import RoutedEngine
    from rollopt.engines.sglang import SGLangEngine

    async with RoutedEngine([SGLangEngine(url) for url in config.urls]) as engine:
        yield engine


register_engine("local", LocalEngineConfig, _open_local)
register_engine("sglang", SGLangEngineConfig, _open_sglang)
register_engine("servers", ServersEngineConfig, _open_servers)


@asynccontextmanager
async def _open_sim(config: SimEngineConfig, model: Any, context: EngineContext) -> AsyncIterator[Any]:
    from rollopt.engines.sim import SimEngine
    from rollopt.engines.sim_cost import ModelShape, model_shape

    hf = model.config
    shape = model_shape(config.model_shape) if config.model_shape else ModelShape.from_hf_config(hf, model.name)
    vocab = len(model.tokenizer) if model.tokenizer is not None else hf.vocab_size
    eos = getattr(hf, "eos_token_id", None)
    eos_ids = tuple(eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
    engines = [SimEngine.from_config(config, shape, vocab_size=vocab, eos_token_ids=eos_ids, script=context.script,
                                     tokenizer=model.tokenizer, model_name=shape.name) for _ in range(config.servers)]
    if config.servers == 1:
        context.progress(engines[0].describe())
        async with engines[0]:
            yield engines[0]
        return
    from rollopt.engines.routed import RoutedEngine

    rebalance = {} if config.rebalance else {"rebalance_abs": None}
    async with RoutedEngine(engines, names=[f"sim{i}" for i in range(config.servers)], **rebalance) as routed:
        context.progress(routed.describe())
        yield routed


register_engine("sim", SimEngineConfig, _open_sim)
