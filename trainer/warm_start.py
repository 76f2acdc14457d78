"""Supervised warm start on an environment's demonstrations (:meth:`rollopt.step.Environment.demonstration`).

A demonstration is tokenized exactly as a rollout would be (the same :class:`~rollopt.chat.ChatRenderer`
prompt, each assistant message followed by the end-of-turn token, observation deltas in between), so the
warm-started model sees the token layout RL will show it. The loss is the mean negative log-likelihood of the
assistant tokens only (the tokens a rollout would mark ``GENERATED``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from rollopt.chat import ChatRenderer
from rollopt.errors import ConfigError
from rollopt.step import Environment, Task
from rollopt.trajectory import TokenSpan, Trajectory


def demonstration_trajectory(env: Environment, task: Task, renderer: ChatRenderer) -> Trajectory:
    """The demonstration of ``task`` as a trajectory; its ``GENERATED`` tokens are the assistant's (with NaN
    logprobs and version −1 replaced by 0.0 and 0, as if sampled by version 0)."""
    messages = env.demonstration(task)
    if not messages:
        raise ConfigError(f"environment {env.name!r} has no demonstrations; set warm_start.steps = 0")
    traj = Trajectory.start(f"demo-{task.id}", task.id, task.id,
                            renderer.prompt(env.reset(task), env.prompt_tool_schemas()))
    pending: list = []
    last = None
    for message in messages:
        if message["role"] == "assistant":
            if pending:
                traj.append(TokenSpan.observation(renderer.observation(pending, last)))
                pending = []
            ids = renderer.encode(message["content"]) + [renderer.end_of_turn_id]
            traj.append(TokenSpan.generated(ids, [0.0] * len(ids), [0] * len(ids)))
            last = ids[-1]
        else:
            pending.append(message)
    return traj


def warm_start(model: torch.nn.Module, env: Environment, renderer: ChatRenderer, steps: int, batch_size: int,
               lr: float, seed: int, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps on fresh demonstrations; returns the losses."""
    from rollopt.batch import collate

    if steps <= 0:
        return []
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / 10))
    tasks: Sequence[Task] = env.tasks(steps * batch_size, seed)
    pad = renderer.tokenizer.pad_token_id or 0
    losses = []
    model.train()
    for step in range(steps):
        trajs = [demonstration_trajectory(env, t, renderer) for t in tasks[step * batch_size:(step + 1) * batch_size]]
        batch = collate(trajs, "padded", pad_token_id=pad)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       position_ids=batch.position_ids).logits[:, :-1].float()
        target = batch.input_ids[:, 1:]
        mask = batch.loss_mask[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                reduction="none").view_as(target)
        loss = (nll * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.detach().item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


__all__ = ["demonstration_trajectory", "warm_start"]
