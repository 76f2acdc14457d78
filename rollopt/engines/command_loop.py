"""The skeleton shared by engines whose one loop task owns all state (the embedded and the simulated engine):
the API queues :class:`Command` s and the loop applies them between iterations, so nothing races with an
iteration. A subclass sets ``_live`` (rid -> its request record, with a ``send`` stream), ``_commands``,
``_wakeup`` (an ``anyio.Event``), ``_task_group = None`` and ``_failure = None`` in ``__init__``, implements
``_loop()`` (which sets ``_failure`` if it dies) and applies the queued commands by name."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import anyio

from rollopt.engines.base import Engine, GenerateRequest, PauseMode
from rollopt.errors import BadRequestError, ConfigError, EngineError


@dataclass(eq=False)
class Command:
    """A state change queued by the API and applied by the loop between iterations."""

    name: str
    arg: Any = None
    done: anyio.Event | None = None
    value: Any = None
    error: Exception | None = None


class CommandLoopEngine(Engine):
    """Lifecycle (``async with``), command queue and the commands every such engine answers the same way."""

    async def _loop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> "CommandLoopEngine":
        if self._task_group is not None:
            raise RuntimeError(f"{type(self).__name__} is already running")
        self._task_group = anyio.create_task_group()
        await self._task_group.__aenter__()
        self._task_group.start_soon(self._loop)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task_group is not None, "__aexit__ without __aenter__"
        self._task_group.cancel_scope.cancel()
        await self._task_group.__aexit__(None, None, None)
        self._task_group = None
        for r in list(self._live.values()):
            r.send.close()

    def _require_running(self) -> None:
        if self._task_group is None:
            raise RuntimeError("use the engine inside `async with engine:`")
        if self._failure is not None:
            raise EngineError(f"the engine loop failed: {self._failure!r}")

    def _check_common(self, request: GenerateRequest) -> None:
        """The request checks that do not depend on the engine's model or sizes."""
        if request.sampling.stop and getattr(self, "tokenizer", None) is None:
            raise BadRequestError(f"request {request.rid}: stop strings need an engine built with a tokenizer")
        if request.rid in self._live:
            raise BadRequestError(f"request id {request.rid!r} is already in flight; rids must be unique")
        if not (math.isfinite(request.keep_warm_s) and request.keep_warm_s >= 0):
            raise BadRequestError(f"request {request.rid}: keep_warm_s must be a finite number >= 0, "
                                  f"got {request.keep_warm_s!r}")

    async def _command(self, name: str, arg: Any = None) -> Any:
        """Queue a command, wait until the loop applied it, and return its value (or raise its error)."""
        self._require_running()
        command = Command(name, arg, anyio.Event())
        self._commands.append(command)
        self._wakeup.set()
        await command.done.wait()
        if command.error is not None:
            raise command.error
        if self._failure is not None:
            raise EngineError(f"the engine loop failed: {self._failure!r}")
        return command.value

    async def pause(self, mode: PauseMode = "abort") -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ConfigError(f"pause mode {mode!r}; use 'abort', 'retract' or 'in_place'")
        await self._command("pause", mode)

    async def resume(self) -> None:
        await self._command("resume")

    async def flush_cache(self) -> None:
        await self._command("flush_cache")

    async def health(self) -> bool:
        return self._task_group is not None and self._failure is None
