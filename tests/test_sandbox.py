"""The sandbox pool: typed errors, sessions, lifecycle, and isolation tests that fail if isolation breaks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from rollopt.environments.sandbox import (
    PoolState, PoolStateError, SandboxLimits, SandboxPool, SandboxUnavailable,
)

LIMITS = SandboxLimits(timeout_s=20.0, cpu_s=1, memory_mb=128, max_processes=6, file_size_mb=1,
                       max_output_bytes=1000)


def descendants(pid: int) -> set[int]:
    """Live processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def program(source: str) -> str:
    return textwrap.dedent(source).strip() + "\n"


# ---------------------------------------------------------------------------------------------- results

async def test_output_and_each_failure_kind():
    async with SandboxPool(2, LIMITS) as pool:
        assert (await pool.run("print(6 * 7)")).output == "42\n"
        cases = {
            "1 / 0": "sandbox_exception",
            "import os; os._exit(3)": "sandbox_crash",
            "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)": "sandbox_crash",
            "x = bytearray(512 << 20)": "sandbox_memory",
            "open('big', 'wb').write(b'x' * (2 << 20))": "sandbox_file_size",
            "print('y' * 5000)": "sandbox_output_truncated",
            "import time; time.sleep(60)": "sandbox_timeout",
        }
        for code, kind in cases.items():
            result = await pool.run(code, timeout_s=1.0 if "sleep" in code else None)
            assert result.error is not None and result.error.kind == kind, (code, result)
        assert "ZeroDivisionError" in (await pool.run("1 / 0")).output
        truncated = await pool.run("print('y' * 5000)")
        assert truncated.output.startswith("y" * 1000) and "4001 more bytes" in truncated.output
        with anyio.fail_after(30):
            await pool.wait_ready()
        assert pool.idle == 2


async def test_stateless_calls_share_nothing():
    async with SandboxPool(1, LIMITS) as pool:
        await pool.run("open('note', 'w').write('left behind'); x = 1")
        result = await pool.run("import os; print(os.listdir('.'), 'x' in globals())")
        assert result.output == "[] False\n"


async def test_session_keeps_state_until_released_and_reports_restarts():
    async with SandboxPool(1, LIMITS, max_sessions=2) as pool:
        await pool.run("x = 41\nopen('f', 'w').write('kept')", session="a")
        assert (await pool.run("print(x + 1, open('f').read())", session="a")).output == "42 kept\n"
        assert (await pool.run("print('x' in globals())", session="b")).output == "False\n"
        assert pool.sessions == 2
        crashed = await pool.run("import os; os._exit(1)", session="a")
        assert crashed.error.kind == "sandbox_crash"
        after = await pool.run("print('x' in globals())", session="a")
        assert after.output == "False\n" and after.restarted
        hung = await pool.run("import time; time.sleep(60)", session="b", timeout_s=0.5)
        assert hung.error.kind == "sandbox_timeout"
        assert (await pool.run("print(1)", session="b")).restarted
        await pool.release("a")
        await pool.release("b")
        await pool.release("never-opened")
        assert pool.sessions == 0
        assert (await pool.run("print('x' in globals())", session="a")).output == "False\n"


# ---------------------------------------------------------------------------------------------- isolation

async def test_cannot_read_files_outside_scratch(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    paths = [str(secret), f"/proc/1/root{secret}", str(Path(__file__).resolve()), "/etc/passwd", "/root/.bashrc"]
    async with SandboxPool(1, LIMITS) as pool:
        result = await pool.run(program(f"""
            found = []
            for path in {paths!r}:
                try:
                    found.append(open(path).read())
                except OSError:
                    pass
            print(len(found))
        """))
    assert result.output == "0\n"


async def test_runs_unprivileged_and_sees_only_its_own_processes():
    async with SandboxPool(1, LIMITS) as pool:
        result = await pool.run(program("""
            import json, os
            status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
            print(os.getuid(), int(status["CapEff"], 16), int(status["NoNewPrivs"]))
            print(json.dumps([int(p) for p in os.listdir("/proc") if p.isdigit()]))
        """))
    ids, pids = result.output.splitlines()
    uid, caps, no_new_privs = map(int, ids.split())
    assert uid == pool.uid_base and caps == 0 and no_new_privs == 1
    assert max(json.loads(pids)) < 10  # the sandbox's own pid namespace: init, the supervisor, this call


async def test_cannot_open_a_network_connection():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        async with SandboxPool(1, LIMITS) as pool:
            result = await pool.run(program(f"""
                import socket
                for address in [("127.0.0.1", {port}), ("1.1.1.1", 53), ("10.0.0.1", 80)]:
                    try:
                        socket.create_connection(address, timeout=2).close()
                        print("connected", address)
                    except OSError as exc:
                        print("refused", exc.errno)
            """))
        assert "connected" not in result.output and result.output.count("refused") == 3
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the test's server
    finally:
        server.close()


async def test_cannot_exceed_cpu_memory_process_and_file_limits():
    async with SandboxPool(1, LIMITS) as pool:
        assert (await pool.run("while True: pass")).error.kind == "sandbox_cpu"
        assert (await pool.run("x = [0] * (64 << 20)")).error.kind == "sandbox_memory"
        too_big = "with open('f', 'wb') as f:\n    f.write(b'0' * (1 << 20) + b'1')"
        assert (await pool.run(too_big)).error.kind == "sandbox_file_size"
        forks = await pool.run(program("""
            import os, time
            for n in range(100):
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
        """))
        assert forks.error.kind == "sandbox_processes"
        counted = await pool.run(program("""
            import os, time
            started = 0
            try:
                for n in range(100):
                    if os.fork() == 0:
                        time.sleep(30)
                        os._exit(0)
                    started += 1
            except BlockingIOError:
                pass
            print(started)
        """))
        assert int(counted.output) == LIMITS.max_processes - 1  # the call's own process counts too


async def test_no_process_outlives_its_call_or_the_pool():
    me = os.getpid()
    before = descendants(me)
    daemon = program("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(300)
            os._exit(0)
        print("spawned")
    """)
    async with SandboxPool(2, LIMITS, max_sessions=1) as pool:
        workers = pool.host_pids()
        assert len(workers) == 2  # one supervisor per worker
        assert (await pool.run(daemon)).output == "spawned\n"
        assert pool.host_pids() == workers  # the daemon died with its call
        await pool.run(daemon, session="s")
        assert len(pool.host_pids()) > len(workers)  # a session keeps its processes ...
        await pool.release("s")
        with anyio.fail_after(30):
            await pool.wait_ready()
        assert len(pool.host_pids()) == 2  # ... until it is released
        live = descendants(me) - before
        assert live
    assert pool.host_pids() == set()
    assert descendants(me) - before == set()


async def test_cancelling_a_call_kills_its_worker_and_the_pool_recovers():
    async with SandboxPool(1, LIMITS) as pool:
        with anyio.move_on_after(0.5) as scope:
            await pool.run("import time; time.sleep(60)")
        assert scope.cancelled_caught
        with anyio.fail_after(30):
            await pool.wait_ready()
        assert (await pool.run("print('fresh')")).output == "fresh\n"


async def test_leaving_on_error_closes_everything():
    me = os.getpid()
    before = descendants(me)
    with pytest.raises(RuntimeError, match="boom"):
        async with SandboxPool(2, LIMITS) as pool:
            await pool.run("print(1)", session="s")
            raise RuntimeError("boom")
    assert pool.state is PoolState.CLOSED
    assert descendants(me) - before == set()


# ---------------------------------------------------------------------------------------------- misuse

async def test_misuse_raises_clear_errors():
    pool = SandboxPool(1, LIMITS)
    with pytest.raises(PoolStateError, match="async with"):
        await pool.run("print(1)")
    async with pool:
        with pytest.raises(PoolStateError, match="entered once"):
            await pool.__aenter__()
    assert pool.state is PoolState.CLOSED
    with pytest.raises(PoolStateError, match="closed"):
        await pool.run("print(1)")
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        async with SandboxPool(1, bwrap="/nonexistent/bwrap"):
            pass
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)


# ---------------------------------------------------------------------------------------------- faults

FAULT_PROGRAMS = {
    "ok": "n = globals().get('n', 0) + 1\nprint(n)",
    "crash": "import os; os._exit(1)",
    "kill": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    "hang": "import time; time.sleep(60)",
    "memory": "x = bytearray(1 << 30)",
    "output": "print('z' * 100_000)",
}
EXPECTED_KIND = {"ok": None, "crash": "sandbox_crash", "kill": "sandbox_crash", "hang": "sandbox_timeout",
                 "memory": "sandbox_memory", "output": "sandbox_output_truncated"}
HANG_DEADLINE_S = 2.0  # short, yet long enough that a loaded 2-core CI machine never times out a quick call


def fault_plan(n: int, seed: int) -> list[str]:
    """5% crashes (half os._exit, half SIGKILL), 2% hangs, 4% memory blow-ups, 3% huge outputs, the rest ok."""
    import random
    plan = (["crash", "kill"] * (n * 5 // 200) + ["hang"] * (n * 2 // 100) + ["memory"] * (n * 4 // 100)
            + ["output"] * (n * 3 // 100))
    plan += ["ok"] * (n - len(plan))
    random.Random(seed).shuffle(plan)
    return plan


async def test_fault_injection_every_call_returns_one_typed_result_and_the_pool_recovers():
    """1,000 stateless calls, 6 at a time, with injected crashes, hangs, memory blow-ups and huge outputs."""
    plan = fault_plan(1000, seed=0)
    results: dict[int, tuple] = {}
    next_call = iter(range(len(plan)))
    limits = SandboxLimits(timeout_s=HANG_DEADLINE_S, cpu_s=5, memory_mb=128, max_output_bytes=2000)
    async with SandboxPool(6, limits) as pool:
        async def worker() -> None:
            for i in next_call:
                started = anyio.current_time()
                result = await pool.run(FAULT_PROGRAMS[plan[i]])
                assert i not in results
                results[i] = (result, anyio.current_time() - started)

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(worker)
        with anyio.fail_after(60):
            await pool.wait_ready()
        assert pool.idle == 6 and len(pool.host_pids()) == 6
    assert sorted(results) == list(range(1000))  # every call has exactly one result
    for i, fault in enumerate(plan):
        result, elapsed = results[i]
        assert (result.error.kind if result.error else None) == EXPECTED_KIND[fault], (i, fault, result)
        if fault == "ok":
            assert result.output == "1\n"  # a fresh interpreter each time: nothing leaked from other calls
        assert elapsed < HANG_DEADLINE_S + 10.0  # no call stuck past its deadline (+ waiting for a worker)
    assert sum(fault != "ok" for fault in plan) == 140
    assert pool.host_pids() == set()


async def test_fault_injection_in_sessions_loses_no_trajectory():
    """20 trajectories x 10 calls in sessions: state survives what the interpreter survives, and a call after
    a crash or a hang says the interpreter was restarted."""
    plan = fault_plan(200, seed=1)
    trajectories = {f"traj{t}": plan[10 * t:10 * t + 10] for t in range(20)}
    outcomes: dict[str, list] = {}
    limits = SandboxLimits(timeout_s=HANG_DEADLINE_S, cpu_s=5, memory_mb=128, max_output_bytes=2000)
    async with SandboxPool(2, limits, max_sessions=4) as pool:
        async def episode(tid: str) -> None:
            outcomes[tid] = [await pool.run(FAULT_PROGRAMS[fault], session=tid) for fault in trajectories[tid]]
            await pool.release(tid)

        async with anyio.create_task_group() as tg:
            for tid in trajectories:
                tg.start_soon(episode, tid)
        with anyio.fail_after(60):
            await pool.wait_ready()
        assert pool.sessions == 0 and len(pool.host_pids()) == 2
    assert sorted(outcomes) == sorted(trajectories)
    assert sum(fault != "ok" for fault in plan) == 28
    for tid, plan in trajectories.items():
        assert len(outcomes[tid]) == len(plan)
        count, lost = 0, False
        for fault, result in zip(plan, outcomes[tid]):
            assert (result.error.kind if result.error else None) == EXPECTED_KIND[fault]
            assert result.restarted == lost
            lost = fault in ("crash", "kill", "hang")
            if lost:
                count = 0
            if fault == "ok":
                count += 1
                assert result.output == f"{count}\n"


def test_bench_script_writes_its_report(tmp_path):
    script = Path(__file__).resolve().parents[1] / "bench" / "sandbox.py"
    subprocess.run([sys.executable, str(script), "--repeats", "1", "--calls", "4", "--concurrency", "1,2",
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=240)
    report = json.loads((tmp_path / "sandbox.json").read_text())
    assert report["cold_over_warm_median"] > 1
    assert set(report["throughput_calls_per_s"]["io"]) == {"1", "2"}
    assert (tmp_path / "sandbox.png").stat().st_size > 10_000
