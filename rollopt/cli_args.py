"""The ``rollopt`` command line's arguments (declarations only; :mod:`rollopt.cli` runs the commands)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

BENCH_POLICIES = "sync,async,overlap,overlap+prefix+preempt,auto"


def _rollout_args(p: argparse.ArgumentParser, *, model: str, tasks: int, group: int) -> None:
    p.add_argument("--env", default="calculator",
                   help="environment: a registered name, an installed entry point, pkg.module:Class or file.py:Class")
    p.add_argument("--env-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the environment's constructor (repeatable; TOML values)")
    p.add_argument("--difficulty", type=int, default=1, help="calculator: operations per problem")
    p.add_argument("--engine", default="local", help="a registered engine (default: local, the embedded one)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a field of the engine's configuration (rollopt.config; repeatable)")
    p.add_argument("--model", default=model, help="'tiny', 'smollm2' or an HF model directory")
    p.add_argument("--tasks", type=int, default=tasks, help="number of tasks")
    p.add_argument("--group-size", type=int, default=group, help="samples per task (a GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="per turn")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0, help="fixes tasks and every request's sampling seed")
    p.add_argument("--scheduler", default="overlap+prefix", help="scheduling policy, e.g. sync, overlap+prefix")
    p.add_argument("--out", type=Path, default=None, help="write trajectories (OUT.jsonl + OUT.npz)")


def add_commands(parser: argparse.ArgumentParser, handlers: dict[str, Callable]) -> None:
    """Add every subcommand to ``parser``; ``handlers[name]`` runs it (``args.func``)."""
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("--quiet", "-q", action="store_true", help="print only the result (table or summary)")
        p.set_defaults(func=handlers[name])
        return p

    _rollout_args(command("demo", "a short multi-turn calculator rollout with SmolLM2-135M-Instruct"),
                  model="smollm2", tasks=3, group=2)
    _rollout_args(command("rollout", "roll out an environment on the embedded engine and print it"),
                  model="tiny", tasks=4, group=4)
    bench = command("bench", "run scheduling policies side by side on one workload; print the speedup")
    bench.add_argument("--workload", default="tool-heavy",
                       help="tool-heavy, long-tail, branching, group-prefix, calculator, or an environment: a "
                            "registered name, pkg.module:Class or file.py:Class")
    bench.add_argument("--env-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                       help="an option of the environment's constructor (repeatable; TOML values)")
    bench.add_argument("--engine", default="local",
                       help="a registered engine: local (embedded), sglang (a server started for the model)")
    bench.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                       help="a field of the engine's configuration (repeatable), e.g. hardware=H200 "
                            "model_shape=llama-3.1-8b for --engine sim")
    bench.add_argument("--schedulers", default=BENCH_POLICIES,
                       help="comma-separated policies (combine with +); the first 'sync' is the baseline")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved repeats per policy")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--model", default=None, help="override the workload's model ('tiny', 'smollm2', a dir)")
    bench.add_argument("--tasks", type=int, default=None, help="override the workload's groups per step")
    bench.add_argument("--group-size", type=int, default=None, help="override the workload's group size")
    bench.add_argument("--trajectories", type=int, default=None,
                       help="trajectories per step (a multiple of the group size; instead of --tasks)")
    bench.add_argument("--hardware", default=None, help="--engine sim: the roofline's GPU (H100-SXM, H200, ...)")
    bench.add_argument("--model-shape", default=None, help="--engine sim: a model shape, e.g. llama-3.1-8b")
    bench.add_argument("--servers", type=int, default=None,
                       help="--engine sim: simulated servers behind the real RoutedEngine")
    bench.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    bench.add_argument("--plot", type=Path, default=None, help="write speedup bars and timelines as PNG")
    bench.add_argument("--trace", type=Path, default=None, help="write a Perfetto trace + graph per policy here")
    bench.add_argument("--track", default=None, metavar="BACKENDS",
                       help="also log the report to experiment trackers, comma-separated: tensorboard, wandb")
    bench.add_argument("--track-dir", type=Path, default=None,
                       help="where the trackers write (default: runs/bench-<workload>)")
    bench.add_argument("--wandb-mode", default="offline", choices=("offline", "online"),
                       help="W&B: offline (no account, no network; `wandb sync` later) or online")
    calibrate = command("calibrate", "fit the simulated engine's cost model to a real engine (writes a cost file)")
    calibrate.add_argument("--engine", default="local", help="the engine to measure: local (embedded), sglang")
    calibrate.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                           help="a field of the engine's configuration (repeatable), as for bench")
    calibrate.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or an HF model directory")
    calibrate.add_argument("--repeats", type=int, default=3, help="interleaved rounds of every probe (median)")
    calibrate.add_argument("--out", type=Path, default=None, help="the cost file (default: costs/ENGINE-MODEL.json)")
    train = command("train", "train with the optimized rollout from a recipe (recipes/*.toml)")
    train.add_argument("--recipe", type=Path, required=True, help="a TOML recipe, e.g. recipes/calculator-tiny.toml")
    train.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<recipe name>)")
    train.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/latest")
    train.add_argument("--steps", type=int, default=None, help="shorthand for loop.steps=N")
    train.add_argument("--track", default=None, metavar="BACKENDS",
                       help="experiment trackers, comma-separated: tensorboard, wandb (W&B offline unless "
                            "tracking.wandb_mode=online); overrides the recipe's [tracking] backends")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. loop.mode=sync rollout.scheduler=sync")
    report = command("report", "plots and a summary of a training run: learning, staleness, mismatch, time")
    report.add_argument("run_dir", type=Path, help="a directory written by rollopt train")
    report.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: RUN_DIR/report)")
    validate = command("validate", "check that each policy keeps the semantics of its risk class")
    validate.add_argument("--scheduler", default=None, help="one policy (e.g. overlap+prefix); default: --all")
    validate.add_argument("--all", action="store_true", help="every registered policy")
    validate.add_argument("--env", default=None, help="check on this environment (name, pkg.module:Class, "
                                                      "file.py:Class) instead of the synthetic workload")
    validate.add_argument("--env-option", "-o", action="append", default=[], metavar="KEY=VALUE",
                          help="an option of the environment's constructor (repeatable; TOML values)")
    validate.add_argument("--json", type=Path, default=None, help="write one record per check")
    validate.add_argument("--check", action="append", default=[], metavar="NAME",
                          help="run only this check of each policy's risk class (repeatable), e.g. token-parity")
    validate.add_argument("--e2e", action="store_true",
                          help="also a short training run per policy: reward curve vs sync (slower, ~10 s each)")
    serve = command("serve-sglang", "run an SGLang server (sglang==0.5.23, CPU) for an HF model directory")
    serve.add_argument("--model", required=True, type=Path, help="HF model directory (config.json + safetensors)")
    serve.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    serve.add_argument("--python", type=Path, default=None, help="interpreter of the SGLang venv (.venv-sglang)")
    serve.add_argument("sglang_args", nargs=argparse.REMAINDER, help="after --: more sglang.launch_server flags")
