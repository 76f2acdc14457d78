"""Training checkpoints: everything needed to continue a run at the next step as if it had not stopped.

A checkpoint directory holds

* ``model.safetensors``: the trainer's weights (HF parameter names; also what the engine is synced with);
* ``optimizer.pt``: the optimizer state (AdamW moments and step counts);
* ``state.pt``: the step just completed, the policy version, the Python/NumPy/torch RNG states, and the
  rollout carry-over (:class:`rollopt.episodes.CarryOver`: complete groups beyond the quota and preempted
  trajectories with every token they had) taken at the end of the rollout that fed this step;
* ``DONE``: written last. A directory without it (the process died while writing) is ignored.

:func:`save_checkpoint` writes into a temporary sibling and renames it into place, so ``latest`` always names
a complete checkpoint even if the process is killed mid-write.
"""

from __future__ import annotations

import pickle
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rollopt.episodes import CarryOver
from rollopt.errors import ConfigError


@dataclass
class TrainState:
    step: int  # the last completed step (0 before the first)
    version: int  # the policy version after that step's update
    carry_over: CarryOver = field(default_factory=CarryOver)
    extra: dict[str, Any] = field(default_factory=dict)


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(root: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState) -> Path:
    """Write ``root/step-{N}`` atomically and point ``root/latest`` at it; keep only the newest two."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:06d}"
    tmp = root / f".tmp-step-{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, tmp / "model.safetensors")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    payload = {"step": state.step, "version": state.version, "rng": _rng_state(), "extra": state.extra,
               "carry_over": pickle.dumps(state.carry_over)}
    torch.save(payload, tmp / "state.pt")
    (tmp / "DONE").write_text(str(state.step))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    link = root / "latest"
    tmp_link = root / ".latest"
    tmp_link.unlink(missing_ok=True)
    tmp_link.symlink_to(final.name)
    tmp_link.replace(link)
    for old in sorted(root.glob("step-*"))[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    link = Path(root) / "latest"
    if link.exists() and (link / "DONE").exists():
        return link.resolve()
    return None


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainState:
    """Load weights and optimizer state in place, restore the RNGs, return the step/version/carry-over."""
    path = Path(path)
    if not (path / "DONE").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no DONE marker)")
    model.load_state_dict(load_file(path / "model.safetensors"))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    payload = torch.load(path / "state.pt", weights_only=False)
    carry = pickle.loads(payload["carry_over"])
    if not isinstance(carry, CarryOver):
        raise ConfigError(f"{path} stores its carry-over in the format of an older rollopt (a list of executor "
                          "internals): resume it with that version, or start the run afresh")
    _set_rng_state(payload["rng"])
    return TrainState(step=payload["step"], version=payload["version"], carry_over=carry, extra=payload["extra"])
