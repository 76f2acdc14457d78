"""The ``rollopt`` command line. Thin: each subcommand parses its options and calls the library."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import anyio


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
        async with engine:
            started = time.perf_counter()
            trajs = await run_rollout(env, engine, renderer, specs, args.scheduler)
            return trajs, time.perf_counter() - started

    console.print(f"[bold]{env.name}[/] on the embedded engine with {model.name}: "
                  f"{args.tasks} tasks × {args.group_size} samples")
    with console.status("rolling out"):
        trajs, wall = anyio.run(go)
    if not args.quiet:
        for traj in trajs:
            print_trajectory(console, traj, model.tokenizer)
    console.print(summary_table(trajs, wall, engine.stats))
    if args.out:
        paths = save_trajectories(args.out, trajs)
        console.print(f"wrote {paths[0]} and {paths[1]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollopt", description="Fast multi-turn, tool-using RL rollouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a short multi-turn calculator rollout with SmolLM2-135M-Instruct")
    _rollout_args(demo, model="smollm2", tasks=3, group=2)
    demo.set_defaults(func=_cmd_rollout)
    rollout = sub.add_parser("rollout", help="roll out an environment on the embedded engine and print it")
    _rollout_args(rollout, model="tiny", tasks=4, group=4)
    rollout.set_defaults(func=_cmd_rollout)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
