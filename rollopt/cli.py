"""The ``rollopt`` command line. Thin: each subcommand parses, calls one library function, and prints. Every
:class:`~rollopt.errors.RolloptError` becomes one line naming the fix, exit code 2 (:func:`main`)."""

from __future__ import annotations

import argparse
import gc
import sys
import tomllib
from pathlib import Path
from typing import Any, Awaitable, Callable

from rich.console import Console

from rollopt.cli_args import add_commands
from rollopt.errors import RolloptError


def _run(fn: Callable[[], Awaitable[Any]], engine: Any = None) -> Any:
    """``fn()`` on the clock the engine configuration ``engine`` needs (:func:`rollopt.engines.run`), the startup
    heap frozen: a full GC rescans torch's ~0.5 M objects (0.24 s on the 2-core VM). Unfrozen after (for tests)."""
    from rollopt.engines import run

    gc.collect()
    gc.freeze()
    try:
        return run(fn, engine)
    finally:
        gc.unfreeze()


def _cmd_rollout(args: argparse.Namespace, console: Console) -> int:
    from rollopt.display import print_trajectory, summary_table
    from rollopt.engines import engine_config
    from rollopt.engines.base import SamplingParams
    from rollopt.session import SessionConfig, rollout
    from rollopt.storage import save_trajectories
    from rollopt.trainer.recipe import parse_options

    calc = {"difficulty": args.difficulty, "few_shot": args.model != "tiny"} if args.env == "calculator" else {}
    engine = engine_config(args.engine, **{**({"max_running": 32} if args.engine == "local" else {}),
                                           **parse_options(args.engine_option)})
    config = SessionConfig(args.model, args.env, {**calc, **parse_options(args.env_option)}, engine, args.scheduler,
                           args.seed)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    with console.status(f"{args.env}: {args.tasks} tasks × {args.group_size} on {args.model}"):
        out = _run(lambda: rollout(config, args.tasks, args.group_size, sampling, args.seed))
    for traj in () if args.quiet else out.trajectories:
        print_trajectory(console, traj, out.tokenizer)
    console.print(summary_table(out.trajectories, out.wall_s, out.engine_stats))
    if args.out:
        console.print("wrote " + " and ".join(map(str, save_trajectories(args.out, out.trajectories))))
    return 0


def _cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from rollopt.benchmark.report import in_turn_overlap, plot, table, track_report
    from rollopt.benchmark.runner import BenchRun, bench, engine_config, save_report
    from rollopt.benchmark.workloads import get_workload, with_trajectories
    from rollopt.schedulers import build_scheduler, split_specs
    from rollopt.trainer.recipe import parse_options
    from rollopt.trainer.trackers import parse_track

    trackers = parse_track(args.track or "")  # an unknown tracker fails before the model loads
    workload = get_workload(args.workload, parse_options(args.env_option), tasks=args.tasks,
                            group_size=args.group_size, model=args.model)
    if args.trajectories is not None:
        workload = with_trajectories(workload, args.trajectories, tasks_given=args.tasks is not None)
    schedulers = split_specs(args.schedulers)
    for name in schedulers:
        build_scheduler(name)  # a typo fails before the model loads
    run = BenchRun(workload, schedulers, repeats=args.repeats, seed=args.seed, trace_dir=args.trace)
    sizes = {"hardware": args.hardware, "model_shape": args.model_shape, "servers": args.servers}
    engine = engine_config(args.engine, workload, **{**parse_options(args.engine_option),
                                                     **{k: v for k, v in sizes.items() if v is not None}})
    with console.status(f"{workload.name} on {args.engine}: {len(schedulers)} policies × {args.repeats}"):
        report = _run(lambda: bench(run, engine), engine)
    console.print(table(report))
    if (overlap := in_turn_overlap(report)) is not None:
        console.print(overlap)
    for path in (plot(report, args.plot) if args.plot else None, save_report(report, args.json) if args.json else None,
                 track_report(report, trackers, args.track_dir, wandb_mode=args.wandb_mode) if trackers else None):
        if path is not None and not args.quiet:
            console.print(f"wrote {path}")
    return 0


def _cmd_calibrate(args: argparse.Namespace, console: Console) -> int:
    from rollopt.benchmark.runner import engine_config
    from rollopt.display import calibration_table
    from rollopt.engines.sim_calibration import calibrate_engine
    from rollopt.trainer.recipe import parse_options

    engine = engine_config(args.engine, **parse_options(args.engine_option))
    out = args.out or Path("costs") / f"{args.engine}-{args.model}.json"
    with console.status(f"calibrating {args.engine} with {args.model}") as status:
        fit = _run(lambda: calibrate_engine(engine, args.model, repeats=args.repeats, progress=status.update), engine)
    console.print(calibration_table(fit))
    console.print(f"wrote {fit.save(out)}; use it with --engine sim --engine-option cost_file={out}")
    return 0


def _cmd_train(args: argparse.Namespace, console: Console) -> int:
    from rollopt.display import train_step_line
    from rollopt.trainer.loop import Trainer
    from rollopt.trainer.recipe import load_recipe
    from rollopt.trainer.trackers import parse_track

    track = [f"tracking.backends={list(parse_track(args.track))!r}"] if args.track is not None else []
    recipe = load_recipe(args.recipe, [*args.overrides, *([f"loop.steps={args.steps}"] if args.steps else []), *track])
    out = args.out or Path("runs") / recipe.name
    if not args.quiet:
        console.print(f"[bold]{recipe.name}[/]: mode {recipe.loop.mode}, scheduler {recipe.rollout.scheduler}, "
                      f"engine {recipe.rollout.engine}; writing {out}")
    _run(Trainer(recipe, out, resume=args.resume, log=lambda m: console.print(train_step_line(m)),
                 progress=console.print).run)
    console.print(f"wrote {out / 'metrics.jsonl'}, {out / 'curves.png'}, {out / 'checkpoints'}")
    return 0


def _cmd_report(args: argparse.Namespace, console: Console) -> int:
    from rollopt.report import report

    summary, paths = report(args.run_dir, args.out)
    console.print(summary, markup=False, highlight=False)
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _cmd_validate(args: argparse.Namespace, console: Console) -> int:
    from rollopt.display import validate_table
    from rollopt.environments import build_environment
    from rollopt.schedulers import SCHEDULERS
    from rollopt.trainer.recipe import parse_options
    from rollopt.validate import save_results, validate_policies

    specs = sorted(SCHEDULERS) if args.all or not args.scheduler else [args.scheduler]
    env = build_environment(args.env, **parse_options(args.env_option)) if args.env else None
    row = (lambda r: None) if args.quiet else (lambda r: console.print(f"{r.scheduler:>24} {r.check:<13} "
                                                                       f"{'pass' if r.passed else 'FAIL'}"))
    results = _run(lambda: validate_policies(specs, None, row, args.e2e, env, args.check or None))
    console.print(validate_table(results))
    if args.json:
        save_results(results, args.json)
    return 0 if all(r.passed for r in results) else 1


def _cmd_serve_sglang(args: argparse.Namespace, console: Console) -> int:
    from rollopt.engines.sglang_server import main_serve

    extra = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
    return main_serve(args.model, args.port, extra_args=extra, python=args.python)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollopt", description="Fast multi-turn, tool-using RL rollouts.")
    add_commands(parser, {"rollout": _cmd_rollout, "demo": _cmd_rollout, "bench": _cmd_bench,
                          "calibrate": _cmd_calibrate, "train": _cmd_train,
                          "report": _cmd_report, "validate": _cmd_validate, "serve-sglang": _cmd_serve_sglang})
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args, Console(soft_wrap=True))
    except* (RolloptError, FileNotFoundError, tomllib.TOMLDecodeError) as error:  # alone or from a task group
        while isinstance(error, BaseExceptionGroup):  # the first one
            error = error.exceptions[0]
        print(f"rollopt {args.command}: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
