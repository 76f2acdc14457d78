"""Readable console output of trajectories (rich)."""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from rollopt.trajectory import TokenKind, Trajectory


def print_trajectory(console: Console, traj: Trajectory, tokenizer: Any) -> None:
    kinds = {k: int((traj.kinds == k).sum()) for k in TokenKind}
    versions = sorted({int(v) for v in traj.versions[traj.loss_mask]})
    console.rule(f"[bold]{traj.id}[/] · {traj.status.value} · reward {traj.reward}")
    console.print(f"tokens: {kinds[TokenKind.PROMPT]} prompt, {kinds[TokenKind.GENERATED]} generated "
                  f"(versions {versions}), {kinds[TokenKind.OBSERVATION]} observation")
    for turn in traj.turns:
        text = tokenizer.decode(traj.token_ids[turn.gen_start:turn.gen_end].tolist())
        console.print(f"[cyan]turn {turn.index}[/] ({turn.finish_reason}):")
        console.print(text.strip(), markup=False, highlight=False)
        for call, result in zip(turn.tool_calls, turn.tool_results):
            status = "ok" if result.ok else f"error {result.error.kind}"
            console.print(f"  tool {call.name}({call.arguments}) -> {result.content!r} [{status}]", markup=False,
                          highlight=False)
        for err in turn.parse_errors:
            console.print(f"  parse error: {err.message}", markup=False, highlight=False)
    if traj.error:
        console.print(f"error {traj.error.kind}: {traj.error.message}", markup=False, highlight=False)


def summary_table(trajectories: Sequence[Trajectory], wall_s: float, stats: Any) -> Table:
    n = len(trajectories)
    rewards = [t.reward or 0.0 for t in trajectories]
    table = Table(title="rollout summary")
    for col in ("trajectories", "mean reward", "tool calls", "generated tokens", "prefill computed",
                "prefill cached", "wall s", "gen tok/s"):
        table.add_column(col, justify="right")
    generated = sum(t.num_generated for t in trajectories)
    table.add_row(str(n), f"{sum(rewards) / max(n, 1):.2f}", str(sum(len(t.tool_calls) for t in trajectories)),
                  str(generated), str(getattr(stats, "prefill_tokens", "-")), str(getattr(stats, "cached_tokens", "-")),
                  f"{wall_s:.1f}",
                  f"{generated / wall_s:.1f}")
    return table


def validate_table(results: Sequence[Any]) -> Table:
    """``rollopt validate``'s table: one row per check."""
    table = Table(title="rollopt validate · local · tiny-llama")
    for col in ("scheduler", "risk", "check", "passed", "statistic", "p", "n"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r.scheduler, r.risk_class or "-", r.check, "yes" if r.passed else "[red]NO[/]",
                      f"{r.statistic:.3g}", "-" if r.p_value is None else f"{r.p_value:.3g}", str(r.n))
    return table


def train_step_line(m: dict[str, Any]) -> str:
    """One line per training step: version, reward, length, KL, staleness, mismatch, accounting, times."""
    stale = m.get("staleness/mean")
    return (f"step {m['step']:>3}  v{m['policy_version']:<3} reward {m['reward_mean']:.3f}"
            + (f"  eval {m['eval_reward']:.3f}" if "eval_reward" in m else "")
            + f"  len {m['response_length_mean']:.0f}  kl {m.get('ppo_kl', float('nan')):.1e}"
            + (f"  stale {stale:.2f}" if stale is not None else "")
            + f"  |Δlogp|₀ {m.get('mismatch/lag0/abs_dlogp', float('nan')):.1e}"
            + f"  trained {m['trained']}/{m['started']} started, carried {m['carried']}"
            + f"  rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s")
