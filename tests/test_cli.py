import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from rollopt.cli import _run, main
from rollopt.storage import load_trajectories

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_the_subcommands():
    out = subprocess.run([Path(sys.executable).parent / "rollopt", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "rollout"):
        assert command in out.stdout


def test_rollout_command_runs_and_writes_trajectories(tmp_path, capsys):
    assert main(["rollout", "--model", "tiny", "--tasks", "2", "--group-size", "2", "--max-new-tokens", "8",
                 "--out", str(tmp_path / "roll")]) == 0
    printed = capsys.readouterr().out
    assert "rollout summary" in printed and "calc-0-0.s1" in printed
    trajs = load_trajectories(tmp_path / "roll")
    assert len(trajs) == 4 and all(t.num_generated > 0 for t in trajs)


def test_commands_hide_the_startup_heap_from_the_collector_only_while_they_run():
    import gc

    async def frozen_count() -> int:
        return gc.get_freeze_count()

    assert gc.get_freeze_count() == 0
    assert _run(frozen_count) > 1000  # the imported libraries: full collections skip them
    assert gc.get_freeze_count() == 0  # an in-process caller gets its normal collector back


def test_wheel_installs_the_mapped_packages(tmp_path):
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ into the source tree
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", ".git", "build", "*.egg-info", "runs",
                                                             "results", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(src)], check=True, capture_output=True)
    [wheel] = tmp_path.glob("rollopt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in ("rollopt/schedulers/__init__.py", "rollopt/trainer/advantages.py",
                 "rollopt/environments/calculator.py", "rollopt/engines/local.py"):
        assert path in names


def test_editable_install_imports_from_any_directory(tmp_path):
    code = "import rollopt, rollopt.schedulers, rollopt.trainer, rollopt.environments; print(rollopt.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("rollopt/__init__.py")


def test_a_config_error_raised_inside_a_task_group_is_one_line_with_exit_2(monkeypatch, capsys, tmp_path):
    """An engine or environment started in a task group raises its ConfigError wrapped in an ExceptionGroup;
    the command still prints the one line with the fix, not a traceback."""
    import rollopt.cli as cli
    from rollopt.errors import ConfigError

    def failing(args, console):
        raise ExceptionGroup("unhandled errors in a TaskGroup", [ConfigError("engine.kv_tokens: use an int")])

    monkeypatch.setattr(cli, "_cmd_report", failing)
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "rollopt report: engine.kv_tokens: use an int\n"


def test_bench_sizes_a_simulated_run_by_trajectories_hardware_shape_and_servers(tmp_path, capsys):
    """``--trajectories``, ``--hardware``, ``--model-shape`` and ``--servers`` size a run on the simulated engine;
    the report names the shape it priced, not the tokenizer's model, and says it is a projection."""
    out = tmp_path / "sim.json"
    assert main(["bench", "--engine", "sim", "--workload", "swe-agent", "-o", "token_scale=0.05", "--trajectories",
                 "16", "--hardware", "H100-SXM", "--model-shape", "qwen2.5-7b", "--servers", "2", "--schedulers",
                 "async,kv[idle_fill=0,min_decoding=0]", "--repeats", "1", "--json", str(out), "--quiet"]) == 0
    import json

    report = json.loads(out.read_text())
    assert [p["scheduler"] for p in report["policies"]] == ["async", "kv[idle_fill=0,min_decoding=0]"]
    assert [p["returned_trajectories"] for p in report["policies"]] == [16, 16]
    assert report["model"] == "qwen2.5-7b (tokenizer: tiny-llama)"
    assert "2 servers" in report["engine_description"]
    assert "roofline:H100-SXM:qwen2.5-7b:tp1 (projection)" in report["engine_description"]
    for argv, message in ((["--trajectories", "12"], "not a positive multiple of swe-agent's group size 8"),
                          (["--trajectories", "16", "--tasks", "2"], "give --trajectories or --tasks, not both"),
                          (["--hardware", "H200"], "engine 'local' has no option(s) ['hardware']"),
                          (["--schedulers", "async,kv[fil=0.9]"], "scheduler 'kv' has no option ['fil']")):
        capsys.readouterr()
        assert main(["bench", "--workload", "swe-agent", "--schedulers", "async", *argv]) == 2
        assert message in capsys.readouterr().err
