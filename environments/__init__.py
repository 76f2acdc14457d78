"""Bundled environments. Each module exports one :class:`rollopt.step.Environment` subclass; the registry maps
a name to it so configs and the CLI can say ``--env calculator``."""

from __future__ import annotations

from rollopt.environments.calculator import CalculatorEnv
from rollopt.environments.gym_adapter import GymTextEnv
from rollopt.environments.python_tool import PythonToolEnv
from rollopt.environments.retrieval import RetrievalEnv
from rollopt.environments.synthetic import SyntheticEnv
from rollopt.errors import ConfigError
from rollopt.step import Environment

ENVIRONMENTS: dict[str, type[Environment]] = {
    env.name: env for env in (CalculatorEnv, SyntheticEnv, PythonToolEnv, RetrievalEnv)
}
"""Environments buildable by name. :class:`GymTextEnv` is an adapter around a game you pass in, so it is not
listed."""


def build_environment(name: str, **kwargs) -> Environment:
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)


__all__ = ["ENVIRONMENTS", "CalculatorEnv", "GymTextEnv", "PythonToolEnv", "RetrievalEnv", "SyntheticEnv",
           "build_environment"]
