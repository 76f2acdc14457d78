"""Wrong input at the configuration boundary, for every key: a one-line ConfigError that names the key, before
anything is built (property-based, derandomized so CI draws the same examples every run)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rollopt.errors import ConfigError
from rollopt.trainer.recipe import Recipe, load_recipe

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=60,
                    suppress_health_check=[HealthCheck.too_slow])


def _leaf_keys() -> list[tuple[str, type]]:
    """Every ``section.key`` of a recipe with its annotation (dict-valued keys excluded: any table is valid)."""
    out = []
    for section in dataclasses.fields(Recipe):
        cls = type(getattr(Recipe(), section.name))
        if not dataclasses.is_dataclass(cls):
            continue
        hints = typing.get_type_hints(cls)
        out += [(f"{section.name}.{f.name}", hints[f.name]) for f in dataclasses.fields(cls)
                if typing.get_origin(hints[f.name]) is not dict]
    return out


KEYS = _leaf_keys()
WRONG = st.one_of(st.dictionaries(st.sampled_from("abc"), st.integers(), min_size=1),
                  st.lists(st.dictionaries(st.sampled_from("xy"), st.booleans(), min_size=1), min_size=1, max_size=2))


def _toml(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "true" if value is True else "false" if value is False else repr(value)


@SETTINGS
@given(key=st.sampled_from(KEYS), value=WRONG)
def test_a_wrong_typed_value_for_any_key_names_the_key(key, value):
    name, _ = key
    with pytest.raises(ConfigError) as info:
        load_recipe(None, [f"{name}={_toml(value)}"])
    message = str(info.value)
    assert name in message and "\n" not in message


def test_every_leaf_key_is_covered():
    assert len(KEYS) >= 50  # the property above draws from all of them


@settings(SETTINGS, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
          max_examples=25)
@given(word=st.text(st.characters(categories=("L", "N", "P")), min_size=1, max_size=12))
def test_unknown_names_on_the_command_line_are_one_line_errors(word, capsys):
    from rollopt.cli import main
    from rollopt.environments import ENVIRONMENTS
    from rollopt.schedulers import SCHEDULERS

    assume(":" not in word and "+" not in word and not word.startswith("-") and word.strip() == word)
    assume(word not in SCHEDULERS and word not in ENVIRONMENTS)
    capsys.readouterr()  # capsys is shared by the examples: each reads only its own output
    for argv in (["rollout", "--scheduler", word], ["rollout", "--env", word], ["rollout", "--engine", word],
                 ["bench", "--workload", word], ["validate", "--scheduler", word, "--check", "token-parity"]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"rollopt {argv[0]}: ") and "\n" not in err
