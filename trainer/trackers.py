"""Experiment trackers: each step's metrics to TensorBoard and to Weights & Biases, through the libraries.

A :class:`Tracker` takes a step's metrics dict (``log(metrics, step)``) and is closed once (``close()``).
:func:`build_trackers` builds the ones a run asks for (recipe ``[tracking] backends``, or ``--track``); the
packages are optional (``pip install 'rollopt[trackers]'``) and imported only when a tracker is built.

Contract of ``log``:

* only numbers are logged (``bool`` as 0/1); strings, ``None`` and NaN are left out — a metric with no value
  at a step is a gap in its curve, never a 0 — and so is ``step``, which is the x axis;
* names are renamed by ``rename`` (default :data:`VERL_NAMES`): a metric with a verl counterpart is logged
  once, under verl's name, so a verl or slime user's dashboards and habits carry over (``actor/ppo_kl``,
  ``critic/rewards/mean``, ``timing_s/gen``); every other metric keeps its rollopt name (``staleness/*``,
  ``mismatch/*``, ``timeline/*``, ``attribution/*``, ...). Nothing is logged twice, so no chart is doubled.
  ``metrics.jsonl`` keeps rollopt's names; ``metric_names="rollopt"`` logs those to the trackers too.

Backends:

* ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` on ``OUT/tensorboard`` (``tensorboard --logdir``),
  flushed after every step so a crash loses nothing; the run's config is logged once as text. ``first_step``
  (the step the run logs first) hides events at or after it that an earlier run left in the directory: steps
  logged past the checkpoint a crash rolled back, or a whole earlier run when it starts again at step 1.
* ``wandb``: one run per tracker (``reinit="create_new"``, so several coexist in a process) under
  ``OUT/wandb``. ``mode="offline"`` (the default) needs no account and no network:
  ``wandb sync OUT/wandb/offline-run-*`` uploads it later; ``"online"`` needs ``wandb login``. W&B does not
  capture the console (``console="off"``) or read git, and prints nothing (``silent``). Offline, the tracker also turns off wandb's error reports
  (``WANDB_ERROR_REPORTING=false`` unless set: the one process-wide setting it touches, as wandb reads it only
  from the environment), so nothing leaves the machine.

The metrics file (``metrics.jsonl``) is not a tracker: the trainer writes it before each checkpoint and
truncates it on a resume, an ordering a generic sink should not own.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from rollopt.errors import ConfigError

INSTALL_HINT = "pip install 'rollopt[trackers]'"

# rollopt metric name → verl's name for the same quantity (verl/trainer/ppo/metric_utils.py,
# verl/workers/actor/dp_actor.py, verl/trainer/ppo/ray_trainer.py, verl/trainer/ppo/rollout_corr_helper.py).
# Where the two differ in detail, the comment says how. Not mapped, as they measure something else: turns_mean
# (verl's num_turns counts messages: user + assistant + 1), truncated_frac (also counts max_turns, unlike
# response_length/clip_ratio), eval_reward (verl's val-core/<data source>/... key names the data set).
VERL_NAMES: dict[str, str] = {
    "reward_mean": "critic/rewards/mean",  # the environment's reward per trajectory (no KL-in-reward shaping)
    # generated tokens per trajectory, all turns; verl's multi-turn response also counts tool-output tokens
    "response_length_mean": "response_length/mean",
    "response_length_max": "response_length/max",
    "tool_calls_mean": "tool_call_counts/mean",
    "loss": "actor/pg_loss",  # the PPO policy loss (rollopt adds no entropy or KL term)
    "clip_frac": "actor/pg_clipfrac",
    "dual_clip_frac": "actor/pg_clipfrac_lower",  # tokens held by the dual clip (negative advantages)
    "ppo_kl": "actor/ppo_kl",
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "lr": "actor/lr",
    "is_weight_mean": "rollout_corr/rollout_is_mean",  # mean off-policy IS weight over kept tokens
    "rollout_s": "timing_s/gen",  # the step's rollout wall time
    "train_s": "timing_s/update_actor",  # includes the stale-token rescoring of trainer/attribution.py
    "sync_s": "timing_s/update_weights",
    "step_s": "timing_s/step",
}

METRIC_NAMES: dict[str, Mapping[str, str]] = {"verl": VERL_NAMES, "rollopt": {}}


class Tracker(Protocol):
    """Receives each step's metrics; ``close`` once at the end (flushes, finishes the run)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: Mapping[str, Any], rename: Mapping[str, str] = VERL_NAMES) -> dict[str, float]:
    """The loggable part of ``metrics`` under tracker names (see the module docstring)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key == "step" or not isinstance(value, Real):
            continue
        value = float(value)
        if math.isnan(value):
            continue
        out[rename.get(key, key)] = value
    return out


class TensorBoardTracker:
    """Scalars to TensorBoard event files in ``log_dir``."""

    def __init__(self, log_dir: str | Path, config: Mapping[str, Any] | None = None, *,
                 rename: Mapping[str, str] = VERL_NAMES, first_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir, self.rename = Path(log_dir), rename
        self.writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=first_step)
        if config:
            self.writer.add_text("config", "    " + json.dumps(config, indent=2, default=str).replace("\n", "\n    "))

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for tag, value in scalars(metrics, self.rename).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run under ``out_dir/wandb`` (offline by default: no account, no network)."""

    def __init__(self, out_dir: str | Path, run_name: str, config: Mapping[str, Any] | None = None, *,
                 project: str = "rollopt", mode: str = "offline", rename: Mapping[str, str] = VERL_NAMES) -> None:
        import wandb

        if mode == "offline":  # wandb reads this only from the environment, when its service process starts
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        self.rename = rename
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", disable_git=True, save_code=False)
        self.run = wandb.init(dir=str(out_dir), project=project, name=run_name, config=dict(config or {}),
                              mode=mode, reinit="create_new", settings=settings)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(scalars(metrics, self.rename), step=step)

    def close(self) -> None:
        self.run.finish()


BACKENDS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}  # backend → the package it needs
WANDB_MODES = ("offline", "online", "disabled")


@dataclass(frozen=True)
class TrackingConfig:
    """The recipe's ``[tracking]`` section."""

    backends: tuple[str, ...] = ()  # any of "tensorboard", "wandb"; empty: metrics.jsonl only
    project: str = "rollopt"  # the W&B project
    run_name: str = ""  # the W&B run's name (default: the recipe's name)
    wandb_mode: str = "offline"  # "offline" (no account, no network; `wandb sync` later) or "online"
    metric_names: str = "verl"  # "verl": verl's names where they exist (VERL_NAMES); "rollopt": metrics.jsonl's

    def __post_init__(self) -> None:
        check_backends(self.backends, where="tracking.backends")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"tracking.wandb_mode {self.wandb_mode!r}; use one of {WANDB_MODES}")
        if self.metric_names not in METRIC_NAMES:
            raise ConfigError(f"tracking.metric_names {self.metric_names!r}; use one of {tuple(METRIC_NAMES)}")


def check_backends(names: Sequence[str], where: str = "--track") -> None:
    """Raise :class:`ConfigError` naming the known backends for an unknown name (no package is imported)."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ConfigError(f"{where}: unknown tracker {', '.join(map(repr, unknown))}; use any of "
                          f"{', '.join(BACKENDS)}")


def parse_track(text: str) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` → ``("tensorboard", "wandb")``; ``""`` → ``()``; checked by name."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    check_backends(names)
    return names


def build_trackers(names: Sequence[str], out_dir: str | Path, run_name: str,
                   config: Mapping[str, Any] | None = None, *, project: str = "rollopt", wandb_mode: str = "offline",
                   metric_names: str = "verl", first_step: int | None = None) -> list[Tracker]:
    """One tracker per name, writing under ``out_dir``. Raises :class:`ConfigError` for an unknown name or a
    backend whose package is missing (with the install command); trackers built before the failure are closed."""
    check_backends(names)
    if metric_names not in METRIC_NAMES:
        raise ConfigError(f"metric_names {metric_names!r}; use one of {tuple(METRIC_NAMES)}")
    rename = METRIC_NAMES[metric_names]
    out_dir = Path(out_dir)
    built: list[Tracker] = []
    try:
        for name in dict.fromkeys(names):  # once each, in order
            try:
                __import__(BACKENDS[name])
            except ImportError:
                raise ConfigError(f"tracker {name!r} needs the {BACKENDS[name]} package: {INSTALL_HINT}") from None
            if name == "tensorboard":
                built.append(TensorBoardTracker(out_dir / "tensorboard", config, rename=rename,
                                                first_step=first_step))
            else:
                built.append(WandbTracker(out_dir, run_name, config, project=project, mode=wandb_mode, rename=rename))
    except BaseException:
        for tracker in built:
            tracker.close()
        raise
    return built
