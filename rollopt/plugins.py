"""Finding plug-ins by name: entry points of installed packages, ``pkg.module:Object`` and ``file.py:Object``
specs, and checking options against a constructor before anything is built."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from rollopt.errors import ConfigError


def entry_point(group: str, name: str) -> Any | None:
    """The object entry point ``name`` of ``group`` points at, or None if no installed package declares it."""
    for ep in entry_points(group=group, name=name):
        try:
            return ep.load()
        except Exception as exc:
            raise ConfigError(f"entry point {name!r} ({group}) = {ep.value!r} failed to load: {exc}") from None
    return None


def load_object(spec: str, what: str) -> Any:
    """``pkg.module:Name`` (imported) or ``path/to/file.py:Name`` (executed as a module of its own)."""
    target, _, attr = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise ConfigError(f"{what} {spec!r}: no file {path}")
            module_spec = importlib.util.spec_from_file_location(f"rollopt_plugin_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"{what} {spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}") from None
    if not hasattr(module, attr):
        raise ConfigError(f"{what} {spec!r}: {target!r} has no {attr!r}")
    return getattr(module, attr)


def check_call(factory: Any, options: dict[str, Any], what: str) -> None:
    """A one-line ConfigError if ``factory(**options)`` would not bind: names the option and the known ones."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(**options)
    except TypeError as exc:
        known = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        raise ConfigError(f"{what}: {exc} (its options: {known})") from None
