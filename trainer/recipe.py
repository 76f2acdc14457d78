"""Training recipes: a TOML file → a typed, validated :class:`Recipe`; command-line overrides ``section.key=value``.

Every key has a default below; an unknown section or key is an error that lists the known ones, so a typo
never silently falls back to a default. Values of overrides are parsed as TOML (``3``, ``0.5``, ``true``,
``"x"``), and a bare word is taken as a string (``rollout.scheduler=sync``).
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rollopt.config import check_value, parse_value
from rollopt.errors import ConfigError
from rollopt.trainer.losses import LOSS_AGGREGATIONS
from rollopt.trainer.offpolicy import OffPolicyConfig
from rollopt.trainer.trackers import TrackingConfig
from rollopt.trainer.update import UpdateConfig

MODES = ("sync", "one-step-off", "async")


@dataclass(frozen=True)
class ModelSection:
    spec: str = "tiny"  # "tiny" (built in code), "smollm2", or an HF model directory
    hidden_size: int = 64  # tiny only: the shape of the random-init model
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    init_scale: float = 0.02


@dataclass(frozen=True)
class EnvironmentSection:
    name: str = "calculator"
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment class


@dataclass(frozen=True)
class WarmStartSection:
    steps: int = 0  # supervised steps on the environment's demonstrations before RL (0: none)
    batch_size: int = 32
    lr: float = 3e-3
    tasks_seed: int = 10_000  # demonstrations come from tasks disjoint from the RL tasks' seeds


@dataclass(frozen=True)
class RolloutSection:
    engine: str = "local"  # "local" (embedded), "sglang" (a real server, started for the run), "servers", or a registered plug-in
    engine_options: dict[str, Any] = field(default_factory=dict)  # more fields of the engine's config (rollopt.config)
    servers: tuple[str, ...] = ()  # engine = "servers": base URLs of running SGLang servers, routed (RoutedEngine)
    scheduler: str = "overlap+prefix"
    tasks_per_step: int = 8  # GRPO groups per step
    group_size: int = 8
    extra_groups: int = 0  # over-provisioned groups; with a preempting scheduler, stragglers carry over
    max_new_tokens: int = 64  # per turn
    temperature: float = 1.0  # sampling temperature of training rollouts: > 0 (0 is greedy, for evaluation only)
    max_running: int = 64
    invariant_prefill: bool = False  # local engine: bit-exact KV however computed (slower prefill; see engines.local)
    sglang_device: str = "cpu"  # engine = "sglang": the server's --device ("cuda" on a GPU machine)
    sglang_args: tuple[str, ...] = ("--dtype", "float32")  # more sglang.launch_server flags
    eval_tasks: int = 0  # greedy evaluation on this many held-out tasks every eval_every steps (0: none)
    eval_every: int = 5


@dataclass(frozen=True)
class LoopSection:
    mode: str = "sync"  # "sync", "one-step-off" or "async" (rollout up to max_staleness batches ahead)
    steps: int = 20
    checkpoint_every: int = 1
    seed: int = 0


@dataclass(frozen=True)
class AttributionSection:
    sequences: int = 8  # stale trajectories rescored per step with the weights that sampled them (0: off)


@dataclass(frozen=True)
class Recipe:
    name: str = "unnamed"
    description: str = ""
    model: ModelSection = field(default_factory=ModelSection)
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    warm_start: WarmStartSection = field(default_factory=WarmStartSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: UpdateConfig = field(default_factory=UpdateConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    loop: LoopSection = field(default_factory=LoopSection)
    attribution: AttributionSection = field(default_factory=AttributionSection)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self) -> None:
        if self.loop.mode not in MODES:
            raise ConfigError(f"loop.mode {self.loop.mode!r}; use one of {MODES}")
        if self.loop.mode == "async" and self.off_policy.max_staleness is None:
            raise ConfigError("loop.mode = 'async' needs off_policy.max_staleness (how many versions a token may lag)")
        if self.loop.mode == "async" and self.off_policy.max_staleness < 1:
            raise ConfigError("async needs off_policy.max_staleness >= 1; use loop.mode = 'sync' for on-policy")
        if self.algorithm.loss_agg not in LOSS_AGGREGATIONS:
            raise ConfigError(f"algorithm.loss_agg {self.algorithm.loss_agg!r}; use one of {LOSS_AGGREGATIONS}")
        if (self.rollout.engine == "servers") != bool(self.rollout.servers):
            raise ConfigError("rollout.engine = 'servers' goes with rollout.servers = [\"http://host:port\", ...] "
                              "(running SGLang servers), and rollout.servers only with it")
        self.engine_config()  # resolves the engine by name and checks its options
        self._resolve_names()
        if self.loop.mode == "sync" and self.rollout.extra_groups > 0:
            raise ConfigError(f"rollout.extra_groups = {self.rollout.extra_groups} with loop.mode = 'sync': groups "
                              "finished beyond the quota are trained a step later, off-policy; set "
                              "rollout.extra_groups = 0 for on-policy sync, or loop.mode = 'async'")
        if not self.rollout.temperature > 0:
            raise ConfigError(f"rollout.temperature = {self.rollout.temperature}: training rollouts need a temperature "
                              "> 0 (greedy is for evaluation: rollout.eval_tasks); use e.g. rollout.temperature = 1.0")
        if self.rollout.group_size < 2:
            raise ConfigError("rollout.group_size must be >= 2: group-relative advantages need two samples")
        for name, value in [("loop.steps", self.loop.steps), ("rollout.tasks_per_step", self.rollout.tasks_per_step),
                            ("algorithm.minibatches", self.algorithm.minibatches),
                            ("algorithm.micro_batch", self.algorithm.micro_batch),
                            ("loop.checkpoint_every", self.loop.checkpoint_every)]:
            if value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.attribution.sequences < 0:
            raise ConfigError(f"attribution.sequences must be >= 0 (0: off), got {self.attribution.sequences}")

    def _resolve_names(self) -> None:
        """Every name the recipe gives resolves now, before any model is built (a typo costs no warm start)."""
        from rollopt.environments import check_environment_options
        from rollopt.schedulers import build_scheduler
        from rollopt.trainer.advantages import ADVANTAGE_ESTIMATORS as ESTIMATORS

        if self.algorithm.advantage not in ESTIMATORS:
            raise ConfigError(f"algorithm.advantage = {self.algorithm.advantage!r}; use one of {sorted(ESTIMATORS)}")
        check_environment_options(self.environment.name, self.environment.options)
        try:
            build_scheduler(self.rollout.scheduler)
        except ConfigError as exc:
            raise ConfigError(f"rollout.scheduler: {exc}") from None

    def engine_config(self) -> Any:
        """The rollout engine's configuration (:mod:`rollopt.config`): the rollout section's keys for the shipped
        engines, with ``rollout.engine_options`` on top (a plug-in engine takes only those)."""
        from rollopt.engines import engine_config

        r = self.rollout
        shipped = {"local": {"max_running": r.max_running, "batch_invariant": True,
                             "invariant_prefill": r.invariant_prefill, "seed": self.loop.seed},
                   "sglang": {"device": r.sglang_device, "args": r.sglang_args},
                   "servers": {"urls": r.servers}}
        return engine_config(r.engine, **{**shipped.get(r.engine, {}), **r.engine_options})

    def session_config(self) -> Any:
        """The recipe's :class:`rollopt.session.SessionConfig`: model, environment, engine, scheduler, seed."""
        from rollopt.session import SessionConfig

        return SessionConfig(self.model.spec, self.environment.name, dict(self.environment.options),
                             self.engine_config(), self.rollout.scheduler, self.loop.seed)

    @property
    def max_ahead(self) -> int:
        """How many batches the rollout may run ahead of the trainer."""
        return {"sync": 0, "one-step-off": 1}.get(self.loop.mode, self.off_policy.max_staleness or 1)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The resolved recipe as TOML (written next to a run's metrics)."""
        lines: list[str] = [f"name = {_toml_value(self.name)}", f"description = {_toml_value(self.description)}"]
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            if not dataclasses.is_dataclass(value):
                continue
            lines.append(f"\n[{section.name}]")
            nested = []
            for f in dataclasses.fields(value):
                v = getattr(value, f.name)
                if isinstance(v, dict):
                    nested.append((f.name, v))
                elif v is not None:
                    lines.append(f"{f.name} = {_toml_value(v)}")
            for key, table in nested:
                lines.append(f"\n[{section.name}.{key}]")
                lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(where + k for k in unknown)}; known: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        default = known[key].default_factory() if known[key].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            if not isinstance(value, dict):
                raise ConfigError(f"[{where}{key}] must be a table")
            kwargs[key] = _build(type(default), value, f"{where}{key}.")
        else:
            kwargs[key] = check_value(where + key, value, hints[key])
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"bad recipe section {where or 'top level'}: {exc}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not section.key=value (e.g. rollout.scheduler=sync)")
    key, raw = text.split("=", 1)
    return key.strip().split("."), parse_value(raw)


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` pairs as a dict (values parsed as in :func:`parse_override`), e.g. environment options."""
    return {".".join(k): v for k, v in map(parse_override, pairs)}


def load_recipe(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Recipe:
    """Read a recipe (or the defaults when ``path`` is None) and apply ``overrides``."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"recipe {path} does not exist; see recipes/ for the shipped ones")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"recipe {path} is not valid TOML: {exc}") from None
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return _build(Recipe, data, "")
