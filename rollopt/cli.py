"""The ``rollopt`` command line. Thin: each subcommand parses its options and calls the library."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import anyio


@contextmanager
def _frozen_startup_heap() -> Iterator[None]:
    """While the block runs, hide every object alive at its start (the imported libraries, a loaded model)
    from the garbage collector.

    A rollout allocates fast, so full collections come every few seconds, and each one rescans the ~0.5 M
    objects that torch and transformers leave at import (0.24 s a collection on the 2-core VM: two of them in
    ten 256-trajectory batches of ``bench/scheduler_overhead.py``). Frozen, they are skipped. The block's
    end unfreezes them, so an in-process caller (the tests) keeps a normal collector.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _rollout_args(p: argparse.ArgumentParser, *, model: str, tasks: int, group: int) -> None:
    p.add_argument("--env", default="calculator", help="environment name (default: calculator)")
    p.add_argument("--difficulty", type=int, default=1, help="calculator: operations per problem")
    p.add_argument("--model", default=model, help="'tiny', 'smollm2' or an HF model directory")
    p.add_argument("--tasks", type=int, default=tasks, help="number of tasks")
    p.add_argument("--group-size", type=int, default=group, help="samples per task (a GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="per turn")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0, help="fixes tasks and every request's sampling seed")
    p.add_argument("--scheduler", default="overlap+prefix", help="scheduling policy, e.g. sync, overlap+prefix")
    p.add_argument("--out", type=Path, default=None, help="write trajectories (OUT.jsonl + OUT.npz)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")


def _cmd_rollout(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollopt.chat import ChatRenderer
    from rollopt.display import print_trajectory, summary_table
    from rollopt.engines.base import SamplingParams
    from rollopt.engines.local import LocalEngine, LocalEngineConfig
    from rollopt.environments import build_environment
    from rollopt.modeling import load_model
    from rollopt.executor import episode_specs, run_rollout
    from rollopt.storage import save_trajectories

    console = Console()
    env_kwargs = {"difficulty": args.difficulty, "few_shot": args.model != "tiny"} if args.env == "calculator" else {}
    env = build_environment(args.env, **env_kwargs)
    with console.status(f"loading {args.model}"):
        model = load_model(args.model, seed=args.seed)
    renderer = ChatRenderer(model.tokenizer)
    specs = episode_specs(env.tasks(args.tasks, args.seed), args.group_size,
                          SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature), args.seed)
    engine = LocalEngine(model.config, model.state_dict, LocalEngineConfig(max_running=32, max_context=2048),
                         tokenizer=model.tokenizer, model_name=model.name)

    async def go():
        async with engine, env:  # an environment may hold resources for the rollout (python_tool: sandboxes)
            started = time.perf_counter()
            trajs = await run_rollout(env, engine, renderer, specs, args.scheduler)
            return trajs, time.perf_counter() - started

    console.print(f"[bold]{env.name}[/] on the embedded engine with {model.name}: "
                  f"{args.tasks} tasks × {args.group_size} samples")
    with console.status("rolling out"), _frozen_startup_heap():
        trajs, wall = anyio.run(go)
    if not args.quiet:
        for traj in trajs:
            print_trajectory(console, traj, model.tokenizer)
    console.print(summary_table(trajs, wall, engine.stats))
    if args.out:
        paths = save_trajectories(args.out, trajs)
        console.print(f"wrote {paths[0]} and {paths[1]}")
    return 0


def _cmd_serve_sglang(args: argparse.Namespace) -> int:
    """Run a real SGLang server (from .venv-sglang) for a model directory until Ctrl-C."""
    from rollopt.engines.sglang_server import main_serve
    from rollopt.errors import RolloptError

    try:
        extra = args.sglang_args[1:] if args.sglang_args[:1] == ["--"] else args.sglang_args
        return main_serve(args.model, args.port, extra_args=extra, python=args.python)
    except RolloptError as exc:
        print(f"serve-sglang: {exc}", file=sys.stderr)
        return 1


def _cmd_bench(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.progress import Progress

    from rollopt.benchmark.report import plot, table
    from rollopt.benchmark.runner import BenchRun, local_engine, run_policies
    from rollopt.benchmark.workloads import get_workload
    from rollopt.modeling import load_model

    console = Console()
    workload = get_workload(args.workload, tasks=args.tasks, group_size=args.group_size, model=args.model)
    schedulers = tuple(s.strip() for s in args.schedulers.split(",") if s.strip())
    run = BenchRun(workload, schedulers, repeats=args.repeats, seed=args.seed, trace_dir=args.trace)
    with console.status(f"loading {workload.model}"):
        model = load_model(workload.model, seed=args.seed)
    console.print(f"[bold]{workload.name}[/]: {workload.description}")

    def go(engine):
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task("rollout steps", total=len(schedulers) * args.repeats)
            return anyio.run(run_policies, run, model, engine, args.engine,
                             lambda name, rep: progress.update(bar, advance=1, description=f"{name} #{rep + 1}"))

    if args.engine == "local":
        with _frozen_startup_heap():
            report = go(local_engine(model, workload))
    else:
        import tempfile

        from rollopt.engines.sglang import SGLangEngine
        from rollopt.engines.sglang_server import SGLangServer
        from rollopt.modeling.loading import save_hf_dir

        with tempfile.TemporaryDirectory() as tmp:
            with console.status("starting an SGLang server"):
                server = SGLangServer(save_hf_dir(model, tmp), extra_args=["--dtype", "float32"]).start()
            try:
                with _frozen_startup_heap():
                    report = go(SGLangEngine(server.base_url))
            finally:
                server.stop()
    console.print(table(report))
    if args.plot:
        console.print(f"wrote {plot(report, args.plot)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        slim = {**report, "policies": [{k: v for k, v in p.items() if k != "timeline"} for p in report["policies"]]}
        args.json.write_text(json.dumps(slim, indent=2))
        console.print(f"wrote {args.json}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from rollopt.errors import RolloptError
    from rollopt.trainer.loop import Trainer
    from rollopt.trainer.recipe import load_recipe

    console = Console()
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"loop.steps={args.steps}")
    try:
        recipe = load_recipe(args.recipe, overrides)
    except RolloptError as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path("runs") / recipe.name
    console.print(f"[bold]{recipe.name}[/]: {recipe.description}")
    console.print(f"mode {recipe.loop.mode}, scheduler {recipe.rollout.scheduler}, engine {recipe.rollout.engine}, "
                  f"correction {recipe.off_policy.correction}, max_staleness {recipe.off_policy.max_staleness}; "
                  f"writing {out}")

    def log(m):
        stale = m.get("staleness/mean")
        console.print(
            f"step {m['step']:>3}  v{m['policy_version']:<3} reward {m['reward_mean']:.3f}"
            + (f"  eval {m['eval_reward']:.3f}" if "eval_reward" in m else "")
            + f"  len {m['response_length_mean']:.0f}  kl {m.get('ppo_kl', float('nan')):.1e}"
            + (f"  stale {stale:.2f}" if stale is not None else "")
            + f"  |Δlogp|₀ {m.get('mismatch/lag0/abs_dlogp', float('nan')):.1e}"
            + f"  rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s")

    try:
        trainer = Trainer(recipe, out, resume=args.resume, log=log, progress=console.print)
        with _frozen_startup_heap():
            anyio.run(trainer.run)
    except RolloptError as exc:
        print(f"train: {exc}", file=sys.stderr)
        return 1
    console.print(f"wrote {out / 'metrics.jsonl'}, {out / 'curves.png'}, {out / 'checkpoints'}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from rollopt.report import report

    try:
        summary, paths = report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 2
    print(summary)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from rollopt.errors import RolloptError
    from rollopt.schedulers import SCHEDULERS
    from rollopt.validate import validate

    console = Console()
    if args.engine != "local":
        print("validate: only --engine local is implemented (exact parity needs the batch-invariant embedded "
              "engine); SGLang validation is an open item", file=sys.stderr)
        return 2
    specs = sorted(SCHEDULERS) if args.all or not args.scheduler else [args.scheduler]
    table = Table(title="rollopt validate · local · tiny-llama")
    for col in ("scheduler", "risk", "check", "passed", "statistic", "p", "n"):
        table.add_column(col, justify="right")

    def row(r):
        console.print(f"{r.scheduler:>24} {r.check:<13} {'pass' if r.passed else 'FAIL'}")
        table.add_row(r.scheduler, r.risk_class or "-", r.check, "yes" if r.passed else "[red]NO[/]",
                      f"{r.statistic:.3g}", "-" if r.p_value is None else f"{r.p_value:.3g}", str(r.n))

    try:
        with _frozen_startup_heap():
            results = anyio.run(lambda: validate(specs, None, row, e2e=args.e2e))
    except RolloptError as exc:
        print(f"validate: {exc}", file=sys.stderr)
        return 2
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.to_dict() for r in results], indent=2))
        console.print(f"wrote {args.json}")
    return 0 if all(r.passed for r in results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollopt", description="Fast multi-turn, tool-using RL rollouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a short multi-turn calculator rollout with SmolLM2-135M-Instruct")
    _rollout_args(demo, model="smollm2", tasks=3, group=2)
    demo.set_defaults(func=_cmd_rollout)
    rollout = sub.add_parser("rollout", help="roll out an environment on the embedded engine and print it")
    _rollout_args(rollout, model="tiny", tasks=4, group=4)
    rollout.set_defaults(func=_cmd_rollout)
    bench = sub.add_parser("bench", help="run scheduling policies side by side on one workload; print the speedup")
    bench.add_argument("--workload", default="tool-heavy",
                       help="tool-heavy, long-tail, branching, group-prefix or calculator")
    bench.add_argument("--engine", default="local", choices=["local", "sglang"],
                       help="the embedded engine, or a real SGLang server started for the model (.venv-sglang)")
    bench.add_argument("--schedulers", default="sync,async,overlap,overlap+prefix,overlap+prefix+preempt",
                       help="comma-separated policies (combine with +); the first 'sync' is the baseline")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved repeats per policy")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--model", default=None, help="override the workload's model ('tiny', 'smollm2', a dir)")
    bench.add_argument("--tasks", type=int, default=None, help="override the workload's groups per step")
    bench.add_argument("--group-size", type=int, default=None, help="override the workload's group size")
    bench.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    bench.add_argument("--plot", type=Path, default=None, help="write speedup bars and timelines as PNG")
    bench.add_argument("--trace", type=Path, default=None, help="write a Perfetto trace + graph per policy here")
    bench.set_defaults(func=_cmd_bench)
    train = sub.add_parser("train", help="train with the optimized rollout from a recipe (recipes/*.toml)")
    train.add_argument("--recipe", type=Path, required=True, help="a TOML recipe, e.g. recipes/calculator-tiny.toml")
    train.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<recipe name>)")
    train.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest")
    train.add_argument("--steps", type=int, default=None, help="shorthand for loop.steps=N")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. loop.mode=sync rollout.scheduler=sync")
    train.set_defaults(func=_cmd_train)
    report = sub.add_parser("report", help="plots and a summary of a training run: learning, staleness, mismatch, time")
    report.add_argument("run_dir", type=Path, help="a directory written by rollopt train")
    report.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: RUN_DIR/report)")
    report.set_defaults(func=_cmd_report)
    validate = sub.add_parser("validate", help="check that each policy keeps the semantics of its risk class")
    validate.add_argument("--scheduler", default=None, help="one policy (e.g. overlap+prefix); default: --all")
    validate.add_argument("--all", action="store_true", help="every registered policy")
    validate.add_argument("--engine", default="local", choices=["local", "sglang"], help="only local for now")
    validate.add_argument("--json", type=Path, default=None, help="write one record per check")
    validate.add_argument("--e2e", action="store_true",
                          help="also a short training run per policy: reward curve vs sync (slower, ~10 s each)")
    validate.set_defaults(func=_cmd_validate)
    serve = sub.add_parser("serve-sglang", help="run an SGLang server (sglang==0.5.23, CPU) for an HF model directory")
    serve.add_argument("--model", required=True, type=Path, help="HF model directory (config.json + safetensors)")
    serve.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    serve.add_argument("--python", type=Path, default=None, help="interpreter of the SGLang venv (.venv-sglang)")
    serve.add_argument("sglang_args", nargs=argparse.REMAINDER, help="after --: more sglang.launch_server flags")
    serve.set_defaults(func=_cmd_serve_sglang)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
