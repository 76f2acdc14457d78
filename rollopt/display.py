"""Readable console output (rich): trajectories, the rollout summary, a training step's line, the validate
table. Tables and lines fit the console they are printed on (:mod:`rollopt.tables`); nothing here prints
except :func:`print_trajectory`."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rich.console import Console

from rollopt.tables import Column, FitLine, FitTable
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


SUMMARY_COLUMNS = [
    Column("trajectories", "trajectories"),
    Column("reward", "mean reward", "{:.2f}"),
    Column("tool_calls", "tool calls", priority=1),
    Column("generated", "generated tokens", priority=1),
    Column("prefill", "prefill computed", priority=2),
    Column("cached", "prefill cached", priority=2),
    Column("wall_s", "wall s", "{:.1f}"),
    Column("tok_s", "gen tok/s", "{:.1f}"),
]


def summary_table(trajectories: Sequence[Trajectory], wall_s: float, stats: Any) -> FitTable:
    """One row: the rollout's totals (prefill counts from the engine's ``stats``; ``-`` for an engine that keeps
    none). A :class:`rollopt.tables.FitTable`, so it fits the console it is printed on (or
    :func:`rollopt.tables.render_text` for a string)."""
    n = len(trajectories)
    generated = sum(t.num_generated for t in trajectories)
    row = {"trajectories": n, "reward": sum(t.reward or 0.0 for t in trajectories) / max(n, 1),
           "tool_calls": sum(len(t.tool_calls) for t in trajectories), "generated": generated,
           "prefill": getattr(stats, "prefill_tokens", None), "cached": getattr(stats, "cached_tokens", None),
           "wall_s": wall_s,
           "tok_s": generated / wall_s}
    return FitTable([row], SUMMARY_COLUMNS, title="rollout summary")


def train_step_line(m: Mapping[str, Any]) -> FitLine:
    """A training step's metrics as one line; at 80 columns the mismatch, then KL and staleness, then the
    version, length and times are left out (they are all in ``metrics.jsonl``)."""
    nan = float("nan")
    fields = [(f"step {m['step']:>3}", 0), (f"v{m['policy_version']:<3}", 1), (f"reward {m['reward_mean']:.3f}", 0)]
    if "eval_reward" in m:
        fields.append((f"eval {m['eval_reward']:.3f}", 0))
    fields += [(f"len {m['response_length_mean']:.0f}", 1), (f"kl {m.get('ppo_kl', nan):.1e}", 2)]
    if m.get("staleness/mean") is not None:
        fields.append((f"stale {m['staleness/mean']:.2f}", 2))
    fields += [(f"|Δlogp|₀ {m.get('mismatch/lag0/abs_dlogp', nan):.1e}", 3),
               (f"rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s", 1)]
    return FitLine(fields)


VALIDATE_COLUMNS = [
    Column("scheduler", "scheduler", justify="left"),
    Column("risk", "risk", priority=1),
    Column("check", "check", justify="left"),
    Column("passed", "passed", style=lambda v: "red" if v == "NO" else ""),
    Column("statistic", "statistic", "{:.3g}", priority=1),
    Column("p", "p", priority=1),
    Column("n", "n", priority=2),
]


def validate_table(results: Sequence[Any]) -> FitTable:
    """``rollopt validate``'s checks (:class:`rollopt.validate.CheckResult`), one row each; the dropped columns
    are in ``--json``."""
    rows = [{"scheduler": r.scheduler, "risk": r.risk_class or "-", "check": r.check,
             "passed": "yes" if r.passed else "NO", "statistic": r.statistic,
             "p": "-" if r.p_value is None else f"{r.p_value:.3g}", "n": r.n} for r in results]
    return FitTable(rows, VALIDATE_COLUMNS, title="rollopt validate · local · tiny-llama", more_hint="--json")


CALIBRATION_COLUMNS = [
    Column("probe", "batch × prompt × new", justify="left"),
    Column("median_ms", "measured ms", "{:.1f}"),
    Column("fitted_ms", "fitted ms", "{:.1f}"),
    Column("error", "error", "{:+.0%}"),
    Column("range", "measured min-max", priority=1),
    Column("iterations", "iterations", priority=2),
]


def calibration_table(fit: Any) -> FitTable:
    """``rollopt calibrate``'s probes (:class:`rollopt.engines.sim_calibration.CostFit`): measured against what
    the fitted cost model gives for the simulated engine's plan of the same probe."""
    rows = [{"probe": f"{p.probe.batch} × {p.probe.prompt_tokens} × {p.probe.new_tokens}",
             "median_ms": p.median_s * 1e3, "fitted_ms": p.fitted_s * 1e3,
             "error": p.fitted_s / p.median_s - 1, "iterations": p.iterations,
             "range": f"{min(p.measured_s) * 1e3:.1f}-{max(p.measured_s) * 1e3:.1f}"} for p in fit.probes]
    return FitTable(rows, CALIBRATION_COLUMNS, title=f"rollopt calibrate · {fit.cost.name}", more_hint="the file")
