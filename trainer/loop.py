"""The training loop: rollout (any scheduler) → batch → policy update → weight sync → version + 1.

Modes (``loop.mode``), by how far the rollout may run ahead of the trainer:

* ``sync``: roll out step k with version k−1's weights, train, sync, then roll out step k+1. On-policy up to
  inference numerics: every token has staleness 0.
* ``one-step-off``: the rollout of step k+1 runs while step k trains (one batch ahead). The sync after step k
  lands between two engine ticks of that rollout, so its tokens carry version k−1 or k: staleness ≤ 1.
* ``async``: the rollout runs up to ``off_policy.max_staleness`` batches ahead, continuously; preempted
  stragglers resume in a later batch under newer weights, so one trajectory can span several versions.
  Tokens that lag more than ``max_staleness`` are dropped or down-weighted by the correction.

Each token's version comes from the engine (``versions[t]``); staleness is the trainer's version at update
time minus that. The correction (:mod:`rollopt.trainer.offpolicy`) uses it and the behavior logprobs.

Failure policy: a trajectory that *failed* (engine or environment error, no reward) takes its whole group out
of the update (counted in ``dropped_groups``); the rest of the batch trains. Truncated episodes were scored
by the environment like any other.

Conservation (DESIGN invariant 5), logged per step: ``started`` (trajectories the step's rollout started),
``returned`` (what it handed the trainer: carried complete groups first, then the groups that finished
first), ``trained``, ``dropped/failed_group`` (members of a group with a failed trajectory),
``dropped/staleness`` (trajectories whose every token lagged past ``off_policy.max_staleness`` under
``stale = "drop"``), ``carried`` / ``carried_groups`` / ``carried_age_max`` (the executor's carry-over after
the rollout) and, at the last step, ``dropped/shutdown`` (what the run leaves carried: never trained). Over a
run, Σ started = Σ trained + Σ dropped/*, and at every step Σ started = Σ returned + carried. Each step adds
``tasks_per_step + extra_groups − carried groups`` new groups, so the carry-over never grows past
``extra_groups`` groups; a resumed run restores it from the checkpoint and keeps conserving.

Outputs in ``out_dir``: ``metrics.jsonl`` (one line per step, with the rollout's ``timeline/*`` phase times
and the ``attribution/*`` mismatch split of :mod:`rollopt.trainer.attribution`), ``traces/step-NNNN.trace.json``
(each step's rollout as a Perfetto trace, :mod:`rollopt.timeline`), ``recipe.toml`` (as resolved),
``checkpoints/`` (see :mod:`rollopt.trainer.checkpoint`) and ``curves.png``. Resuming (``resume=True``) loads
``checkpoints/latest``, truncates ``metrics.jsonl`` to its step and continues with the next step; in ``sync``
mode the continued run is identical to an uninterrupted one (seeded tasks and sampling, batch-invariant
engine, restored RNG and optimizer).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import anyio
import torch

from rollopt.chat import ChatRenderer
from rollopt.engines.base import Engine, SamplingParams
from rollopt.episodes import CarryOver, EpisodeSpec, episode_specs
from rollopt.executor import RolloutExecutor
from rollopt.seeds import EVAL, step_seed
from rollopt.session import Session, build_session_environment, start_session
from rollopt.timeline import timeline_totals, write_trace
from rollopt.trajectory import Status, Trajectory
from rollopt.trainer.attribution import WeightHistory, attribute_mismatch
from rollopt.trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from rollopt.trainer.distributed import SingleProcess, UpdateOrder, send_replica
from rollopt.trainer.metrics import rollout_metrics
from rollopt.trainer.recipe import Recipe
from rollopt.trainer.update import policy_update
from rollopt.trainer.warm_start import warm_start


@dataclass
class RolloutBatch:
    """What the rollout hands the trainer for one step."""

    step: int
    trajectories: list[Trajectory]
    rollout_s: float
    preempted: int
    started: int  # trajectories this rollout started
    carry: CarryOver = field(default_factory=CarryOver)  # the executor's buffer right after this rollout
    timeline: dict[str, float] = field(default_factory=dict)  # rollopt.timeline.timeline_totals of the rollout


def fully_stale(traj: Trajectory, current_version: int, off_policy) -> bool:
    """Whether the staleness bound drops every generated token of ``traj`` (so it trains on nothing)."""
    if off_policy.max_staleness is None or off_policy.stale != "drop" or traj.num_generated == 0:
        return False
    return bool((current_version - traj.versions[traj.loss_mask]).min() > off_policy.max_staleness)


def build_trainable(recipe: Recipe):
    """``(hf_model, tokenizer, name)`` for the recipe's model section; the model is in fp32 train-ready form."""
    from rollopt.modeling.tiny import build_model, build_tokenizer

    m = recipe.model
    if m.spec == "tiny":
        tokenizer = build_tokenizer()
        model = build_model(len(tokenizer), hidden_size=m.hidden_size, num_layers=m.num_layers,
                            num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, intermediate_size=m.intermediate_size,
                            init_scale=m.init_scale, seed=recipe.loop.seed, eos_token_id=tokenizer.eos_token_id)
        return model, tokenizer, "tiny-llama"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollopt.modeling.loading import smollm2_dir

    path = smollm2_dir() if m.spec == "smollm2" else Path(m.spec)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path), ("SmolLM2-135M-Instruct" if m.spec == "smollm2" else str(path))


def engine_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of the trainer's weights for the engine (the optimizer keeps mutating the originals)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Trainer:
    """Runs a recipe; see the module docstring. ``log`` receives each step's metrics dict as it is written.
    Its environment, engine, policy and renderer come from :mod:`rollopt.session` (the recipe's
    :meth:`~rollopt.trainer.recipe.Recipe.session_config`); it builds only the model it trains. Under
    ``torchrun`` this is rank 0 with ``data_parallel`` (:mod:`rollopt.trainer.distributed`): it alone rolls
    out, syncs weights and writes; each update is sent to the other ranks and runs data-parallel."""

    def __init__(self, recipe: Recipe, out_dir: str | Path, resume: bool = False,
                 log: Callable[[dict[str, Any]], None] = lambda m: None,
                 progress: Callable[[str], None] = lambda msg: None,
                 data_parallel: SingleProcess | None = None) -> None:
        self.recipe, self.out_dir, self.log, self.progress = recipe, Path(out_dir), log, progress
        self.dp = data_parallel or SingleProcess()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(recipe.loop.seed)
        self.model, self.tokenizer, self.model_name = build_trainable(recipe)
        self.renderer = ChatRenderer(self.tokenizer)
        self.session_config = recipe.session_config()
        self.env = build_session_environment(self.session_config)
        a = recipe.algorithm
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                                           betas=tuple(a.adam_betas))
        self.update_config = recipe.algorithm
        self.state = TrainState(step=0, version=0)
        self.weights = WeightHistory(keep=recipe.max_ahead + 2)  # covers a straggler resumed once past the bound
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.trackers: list = []  # built by run(), for its duration (rollopt.trainer.trackers)
        checkpoint = latest_checkpoint(self.out_dir / "checkpoints") if resume else None
        if checkpoint is not None:
            self.state = load_checkpoint(checkpoint, self.model, self.optimizer)
            self._truncate_metrics(self.state.step)
            self.progress(f"resumed from {checkpoint} (step {self.state.step}, version {self.state.version})")
        else:
            if resume:
                self.progress("no checkpoint to resume from; starting fresh")
            self.metrics_path.write_text("")
            ws = recipe.warm_start
            if ws.steps:
                self.progress(f"warm start: {ws.steps} supervised steps on demonstrations")
                losses = warm_start(self.model, self.env, self.renderer, ws.steps, ws.batch_size, ws.lr,
                                    ws.tasks_seed)
                self.progress(f"warm start done, loss {losses[0]:.3f} → {losses[-1]:.3f}")
        (self.out_dir / "recipe.toml").write_text(recipe.to_toml())
        self.pad_token_id = self.tokenizer.pad_token_id or 0

    def _truncate_metrics(self, step: int) -> None:
        if not self.metrics_path.exists():
            return
        keep = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.metrics_path.write_text("".join(line + "\n" for line in keep))

    # ------------------------------------------------------------------------------------------ rollout
    def specs_for_step(self, step: int, carried_groups: int = 0) -> list[EpisodeSpec]:
        """The step's new episodes: ``tasks_per_step + extra_groups − carried_groups`` groups (none while the
        carry-over already holds that many), the first of the step's seeded task list."""
        r, seed = self.recipe.rollout, self.recipe.loop.seed
        tasks = self.env.tasks(r.tasks_per_step + r.extra_groups, step_seed(seed, step))
        tasks = tasks[: max(0, len(tasks) - carried_groups)]
        sampling = SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature)
        return episode_specs(tasks, r.group_size, sampling, step_seed(seed, step))

    async def rollout(self, executor: RolloutExecutor, step: int) -> RolloutBatch:
        started = time.perf_counter()
        specs = self.specs_for_step(step, executor.carried_groups)
        result = await executor.run(specs, target_groups=self.recipe.rollout.tasks_per_step)
        write_trace(result.graph, self.out_dir / "traces" / f"step-{step:04d}.trace.json")
        return RolloutBatch(step, result.trajectories, time.perf_counter() - started, result.preempted,
                            len(result.started), executor.carry, timeline_totals(result.graph))

    async def evaluate(self, engine: Engine) -> float:
        """Greedy reward on ``rollout.eval_tasks`` held-out tasks (a seed no training step uses)."""
        r = self.recipe.rollout
        tasks = self.env.tasks(r.eval_tasks, EVAL + self.recipe.loop.seed)
        specs = episode_specs(tasks, 1, SamplingParams(max_new_tokens=r.max_new_tokens, temperature=0.0), 0)
        result = await RolloutExecutor(self.env, engine, self.renderer, "overlap+prefix").run(specs)
        return sum(t.reward or 0.0 for t in result.trajectories) / max(len(result.trajectories), 1)

    # ------------------------------------------------------------------------------------------ train
    def _trainable(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], int]:
        bad_groups = {t.group_id for t in trajectories if t.status is Status.FAILED or t.reward is None}
        return [t for t in trajectories if t.group_id not in bad_groups], len(bad_groups)

    def _accounting(self, batch: RolloutBatch, trainable: list[Trajectory]) -> dict[str, int]:
        """The step's conservation counts (see the module docstring)."""
        stale = sum(fully_stale(t, self.state.version, self.recipe.off_policy) for t in trainable)
        last = batch.step == self.recipe.loop.steps
        return {"started": batch.started, "returned": len(batch.trajectories), "trained": len(trainable) - stale,
                "dropped/failed_group": len(batch.trajectories) - len(trainable), "dropped/staleness": stale,
                "dropped/shutdown": len(batch.carry) if last else 0, "carried": len(batch.carry),
                "carried_groups": len(batch.carry.groups), "carried_age_max": batch.carry.age_max}

    async def train_step(self, engine: Engine, batch: RolloutBatch, step_started: float) -> dict[str, Any]:
        trajs, dropped = self._trainable(batch.trajectories)
        metrics: dict[str, Any] = {"step": batch.step, **rollout_metrics(batch.trajectories),
                                   **self._accounting(batch, trajs), "dropped_groups": dropped,
                                   "preempted": batch.preempted, "rollout_s": batch.rollout_s, **batch.timeline}
        t0 = time.perf_counter()
        if trajs:
            a = self.recipe.algorithm
            for group in self.optimizer.param_groups:  # a function of the step, so a resume gets the same rate
                group["lr"] = a.lr * (min(1.0, batch.step / a.lr_warmup_steps) if a.lr_warmup_steps else 1.0)
            current = self.state.version

            def attribute_and_update() -> dict[str, Any]:
                split = attribute_mismatch(self.model, trajs, current, self.weights,  # before the update
                                           sequences=self.recipe.attribution.sequences, seed=batch.step,
                                           temperature=self.recipe.rollout.temperature, pad_token_id=self.pad_token_id)
                self.dp.broadcast_object(UpdateOrder(current, self.optimizer.param_groups[0]["lr"], trajs))
                return {**split, **policy_update(self.model, self.optimizer, trajs, current, self.update_config,
                                                 self.recipe.off_policy, self.pad_token_id, self.dp,
                                                 self.recipe.rollout.temperature)}

            metrics.update(await anyio.to_thread.run_sync(attribute_and_update))
        t1 = time.perf_counter()
        weights = engine_weights(self.model)
        self.state.version = await engine.update_weights(weights, version=self.state.version + 1)
        self.weights.record(self.state.version, weights)
        self.state.step = batch.step
        metrics.update({"policy_version": self.state.version, "train_s": t1 - t0,
                        "sync_s": time.perf_counter() - t1, "step_s": time.perf_counter() - step_started,
                        "off_policy_correction": self.recipe.off_policy.correction})
        r = self.recipe.rollout
        if r.eval_tasks and (batch.step % r.eval_every == 0 or batch.step == self.recipe.loop.steps):
            metrics["eval_reward"] = await self.evaluate(engine)
        with open(self.metrics_path, "a") as f:  # before the checkpoint: a resume truncates what it lacks
            f.write(json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v)
                                for k, v in metrics.items()}) + "\n")
        if batch.step % self.recipe.loop.checkpoint_every == 0 or batch.step == self.recipe.loop.steps:
            self.state.carry_over = batch.carry
            await anyio.to_thread.run_sync(save_checkpoint, self.out_dir / "checkpoints", self.model,
                                           self.optimizer, self.state)
        for tracker in self.trackers:
            tracker.log(metrics, step=batch.step)
        self.log(metrics)
        return metrics

    # ------------------------------------------------------------------------------------------ run
    async def run_session(self, session: Session) -> list[dict[str, Any]]:
        """Train until ``loop.steps`` on a started session (:func:`rollopt.session.start_session`) whose engine
        holds this trainer's current weights and whose environment is :attr:`env`."""
        recipe, out, engine = self.recipe, [], session.engine
        if self.state.version > (await engine.info()).version:
            await engine.update_weights(engine_weights(self.model), version=self.state.version)
        self.weights.record(self.state.version, engine_weights(self.model))  # what the engine holds now
        executor = RolloutExecutor(session.env, engine, session.renderer, session.policy)
        executor.restore_carry(self.state.carry_over)
        first, last = self.state.step + 1, recipe.loop.steps
        if first > last:
            return out
        if recipe.max_ahead == 0:
            for step in range(first, last + 1):
                started = time.perf_counter()
                batch = await self.rollout(executor, step)
                out.append(await self.train_step(engine, batch, started))
            return out
        send, receive = anyio.create_memory_object_stream[RolloutBatch](recipe.max_ahead - 1)

        async def produce() -> None:
            async with send:
                for step in range(first, last + 1):
                    await send.send(await self.rollout(executor, step))

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            async with receive:
                started = time.perf_counter()
                async for batch in receive:
                    out.append(await self.train_step(engine, batch, started))
                    started = time.perf_counter()
        return out

    async def run(self) -> list[dict[str, Any]]:
        """Open the session (start the recipe's engine with the current weights, enter the environment), train,
        close it; write ``curves.png``."""
        from rollopt.trainer.plots import plot_curves
        from rollopt.trainer.trackers import build_trackers

        t = self.recipe.tracking
        self.trackers = build_trackers(t.backends, self.out_dir, t.run_name or self.recipe.name, self.recipe.to_dict(),
                                       project=t.project, wandb_mode=t.wandb_mode, metric_names=t.metric_names,
                                       first_step=self.state.step + 1)
        try:
            async with self._session() as session, self.env:
                await anyio.to_thread.run_sync(send_replica, self.dp, self.model, self.optimizer, self.update_config,
                                               self.recipe.off_policy, self.pad_token_id,
                                               self.recipe.rollout.temperature)
                out = await self.run_session(session)
                # the other ranks stop; on a failure torchrun stops them (a stop sent then could meet a collective)
                await anyio.to_thread.run_sync(self.dp.broadcast_object, None)
        finally:
            for tracker in self.trackers:
                tracker.close()
            self.trackers = []
        plot_curves(self.metrics_path, self.out_dir / "curves.png", title=self.recipe.name)
        return out

    def _session(self):
        """The recipe's session on :attr:`env` (:func:`rollopt.session.start_session`), its engine holding the
        trainer's current weights; an async context manager."""
        from rollopt.engines import EngineContext
        from rollopt.modeling import LoadedModel

        model = LoadedModel(self.model.config, engine_weights(self.model), self.tokenizer, self.model_name)
        c = self.session_config
        return start_session(c.engine, self.env, model, c.scheduler, EngineContext(self.out_dir, self.progress))
