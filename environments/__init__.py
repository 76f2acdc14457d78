"""Bundled environments. Each module exports one :class:`rollopt.step.Environment` subclass; the registry maps
a name to it so configs and the CLI can say ``--env calculator``."""

from __future__ import annotations

from rollopt.environments.calculator import CalculatorEnv
from rollopt.environments.synthetic import SyntheticEnv
from rollopt.errors import ConfigError
from rollopt.step import Environment

ENVIRONMENTS: dict[str, type[Environment]] = {CalculatorEnv.name: CalculatorEnv, SyntheticEnv.name: SyntheticEnv}


def build_environment(name: str, **kwargs) -> Environment:
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)}")
    return ENVIRONMENTS[name](**kwargs)


__all__ = ["ENVIRONMENTS", "CalculatorEnv", "SyntheticEnv", "build_environment"]
