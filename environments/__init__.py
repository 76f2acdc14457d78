"""Bundled environments. Each module exports one :class:`rollopt.step.Environment` subclass; the registry maps
a name to it so configs and the CLI can say ``--env calculator``; a user's environment is named the same way
(registered, an entry point, ``pkg.module:Class`` or ``file.py:Class``)."""

from __future__ import annotations

from rollopt.environments.agentic import AgentEnv
from rollopt.environments.calculator import CalculatorEnv
from rollopt.environments.gym_adapter import GymTextEnv
from rollopt.environments.python_tool import PythonToolEnv
from rollopt.environments.retrieval import RetrievalEnv
from rollopt.environments.synthetic import SyntheticEnv
from rollopt.errors import ConfigError
from rollopt.step import Environment

ENVIRONMENTS: dict[str, type[Environment]] = {
    env.name: env for env in (CalculatorEnv, SyntheticEnv, PythonToolEnv, RetrievalEnv, AgentEnv)
}
"""Environments buildable by name. :class:`GymTextEnv` is an adapter around a game you pass in, so it is not
listed."""


ENTRY_POINT_GROUP = "rollopt.environments"
"""Installed packages add environments by name through this entry-point group (``name = "pkg.mod:Class"``)."""


def register_environment(name: str, cls: type[Environment]) -> None:
    """Make ``cls`` buildable as ``name`` in every command and recipe."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"register_environment({name!r}, ...) needs a rollopt.Environment subclass, got {cls!r}")
    ENVIRONMENTS[name] = cls


def environment_class(spec: str) -> type[Environment]:
    """The environment class ``spec`` names: a registered name, an installed package's entry point
    (group ``rollopt.environments``), ``pkg.module:Class`` or ``path/to/file.py:Class``."""
    from rollopt.plugins import entry_point, load_object

    cls = ENVIRONMENTS.get(spec) or entry_point(ENTRY_POINT_GROUP, spec)
    if cls is None and ":" in spec:
        cls = load_object(spec, what="environment")
    if cls is None:
        raise ConfigError(f"unknown environment {spec!r}; known: {sorted(ENVIRONMENTS)}, or give "
                          "'pkg.module:Class' or 'path/to/file.py:Class'")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"environment {spec!r} is {cls!r}, not a rollopt.Environment subclass")
    return cls


def check_environment_options(spec: str, options: dict) -> type[Environment]:
    """Resolve ``spec`` and check ``options`` against its constructor's signature, before anything loads."""
    from rollopt.plugins import check_call

    cls = environment_class(spec)
    check_call(cls, options, f"environment {spec!r}")
    return cls


def build_environment(name: str, **kwargs) -> Environment:
    """An instance of the environment ``name`` names (see :func:`environment_class`), options checked first."""
    return check_environment_options(name, kwargs)(**kwargs)


__all__ = ["ENTRY_POINT_GROUP", "ENVIRONMENTS", "AgentEnv", "CalculatorEnv", "GymTextEnv", "PythonToolEnv", "RetrievalEnv",
           "SyntheticEnv", "build_environment", "check_environment_options", "environment_class",
           "register_environment"]
