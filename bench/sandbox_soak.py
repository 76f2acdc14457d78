"""Sandbox pool soak: thousands of mixed calls (good, crashing, hanging, hostile) from concurrent trajectories.

    .venv/bin/python bench/sandbox_soak.py [--calls 3000] [--trajectories 32] [--size 6] [--seed 0]
                                           [--out bench/results]

Each trajectory runs its share of the calls one after another, half of the trajectories in a session (one
interpreter, released at the end), half stateless; all trajectories run at once. The mix (``KINDS``) holds
ordinary programs, programs that fail in each typed way, and the hostile programs that used to break the
pool's isolation: a 3,000-deep directory tree with permissions taken away, SysV/POSIX IPC objects, kernel
keys, memfds and socket buffers past the memory limit, ``unshare``, a daemon left behind, fork and thread bombs.

Checked, and written to ``sandbox-soak.json``: every call gets exactly one result, of the kind expected for
its program, carrying its own call's token (attribution); no call sees another trajectory's files,
variables, IPC objects or keys (leaks); at the end the pool is back to ``size`` idle workers with one process
each, and after it closes no sandbox process and no host directory is left. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

import anyio

from rollopt.environments.sandbox import SandboxLimits, SandboxPool

LIMITS = SandboxLimits(timeout_s=60.0, cpu_s=10, memory_mb=128, max_processes=8, file_size_mb=16,
                       max_output_bytes=2000)
HANG_TIMEOUT_S = 2.0  # the deadline of the calls that hang; every other call has LIMITS.timeout_s


def _p(source: str) -> str:
    return textwrap.dedent(source).strip() + "\n"


# Programs by kind: a template (TOKEN: the call's token, TID: its trajectory) and the expected error kind.
# "ok" checks what it can see: its scratch directory and its variables hold only its own trajectory's.
_OK = _p("""
    import json, os
    seen = {"files": sorted(os.listdir(".")),
            "variables": sorted(k for k in globals() if k.startswith("secret_") and k != "secret_TID")}
    open("TID-" + "TOKEN".replace(":", "-"), "w").write("TID")
    secret_TID = "TOKEN"
    print("TOKEN", json.dumps(seen))
""")
_DEEP = _p("""
    import os
    os.mkdir("TID-deep-TOKEN".replace(":", "-"))
    os.chdir("TID-deep-TOKEN".replace(":", "-"))
    for i in range(3000):
        os.mkdir("d")
        os.chdir("d")
    for i in range(3000):
        os.chdir("..")
        if i % 700 == 0:
            os.chmod("d", 0)
    os.chdir("..")
    print("TOKEN built")
""")
_IPC = _p("""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    made = [name for name, ok in (("shm", libc.shmget(0, 1 << 20, 0o1600) >= 0),
                                  ("msg", libc.msgget(0, 0o1600) >= 0),
                                  ("sem", libc.semget(0, 1, 0o1600) >= 0),
                                  ("mq", libc.mq_open(b"/TID", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0)) if ok]
    seen = [k for k in ("shm", "msg", "sem") if len(open(f"/proc/sysvipc/{k}").read().splitlines()) > 1]
    print("TOKEN", made, seen)
""")
_KEYS = _p("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    found = libc.syscall(249, b"user", b"rollopt-soak", None, 0) > 0              # request_key: a key left before?
    added = libc.syscall(248, b"user", b"rollopt-soak", b"TOKEN", 5, -4) > 0      # add_key to the user keyring
    print("TOKEN", found, added)
""")
_MEMFD = _p("""
    import os, socket
    held = 0
    try:                                    # memfds: memory the address-space limit does not count
        for _ in range(24):
            fd = os.memfd_create("hold")
            for _ in range(16):
                os.write(fd, b"x" * (1 << 20))
                held += 1 << 20
    except OSError:
        pass
    pairs = []
    try:                                    # socket buffers: neither
        while held < (256 << 20):
            a, b = socket.socketpair()
            pairs.append((a, b))
            a.setblocking(False)
            while True:
                try:
                    held += a.send(b"x" * 65536)
                except BlockingIOError:
                    break
    except OSError:
        pass
    print("TOKEN", held < (128 << 20))
""")
_UNSHARE = _p("""
    import ctypes
    print("TOKEN", ctypes.CDLL(None).unshare(0x10000000) != 0)
""")
_DAEMON = _p("""
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(300)
        os._exit(0)
    print("TOKEN")
""")
_FORK_BOMB = _p("""
    import os, time
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
""")
_THREAD_BOMB = _p("""
    import threading, time
    threading.stack_size(256 << 10)  # small stacks: the process limit, not the memory limit, stops it
    while True:
        threading.Thread(target=time.sleep, args=(30,)).start()
""")

KINDS: dict[str, tuple[str, str | None, int, bool]] = {
    # kind: (program, expected error kind, weight, also in sessions)
    "ok": (_OK, None, 52, True),
    "exception": ("secret_TID = 'TOKEN'\n1 / 0", "sandbox_exception", 5, True),
    "exit": ("import sys; sys.exit(3)", "sandbox_exit", 4, True),
    "crash": ("import os; os._exit(1)", "sandbox_crash", 3, True),
    "kill": ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "sandbox_crash", 2, True),
    "hang": ("import time; time.sleep(600)", "sandbox_timeout", 2, True),
    "memory": ("x = bytearray(1 << 30)", "sandbox_memory", 3, True),
    "output": ("print('z' * 100_000)", "sandbox_output_truncated", 3, True),
    "deep_tree": (_DEEP, None, 4, True),
    "ipc": (_IPC, None, 4, True),
    "keyring": (_KEYS, None, 3, True),
    "memfd": (_MEMFD, None, 3, True),
    "unshare": (_UNSHARE, None, 3, True),
    # these leave processes behind: in a session they would count against its later calls' limits
    "daemon": (_DAEMON, None, 3, False),
    "fork_bomb": (_FORK_BOMB, "sandbox_processes", 2, False),
    "thread_bomb": (_THREAD_BOMB, "sandbox_processes", 2, False),
}
if platform.machine() != "x86_64":
    del KINDS["keyring"]  # its syscall numbers are x86-64's
# what a kind that succeeds prints after its token
_EXPECTED_TAIL = {"deep_tree": "built", "ipc": "[] []", "keyring": "False False", "memfd": "True",
                  "unshare": "True", "daemon": ""}


def plan(calls: int, trajectories: int, seed: int) -> dict[str, tuple[bool, list[str]]]:
    """Trajectory id -> (in a session, kinds of its calls in order)."""
    rng = random.Random(seed)
    out = {}
    for t in range(trajectories):
        session = t % 2 == 1
        kinds = [k for k, v in KINDS.items() if v[3] or not session]
        n = calls // trajectories + (t < calls % trajectories)
        out[f"t{t:03d}"] = (session, rng.choices(kinds, weights=[KINDS[k][2] for k in kinds], k=n))
    return out


def check(kind: str, tid: str, token: str, session: bool, output: str, error: str | None) -> tuple[str, str]:
    """(problem with the result's kind or attribution, leak seen by the program); "" when none."""
    expected = KINDS[kind][1]
    if error != expected:
        return f"expected {expected}, got {error}: {output[:200]!r}", ""
    if kind == "ok":
        first, _, rest = output.partition(" ")
        if first != token:
            return f"output of another call: {output[:200]!r}", ""
        seen = json.loads(rest)
        foreign = [f for f in seen["files"] if not (session and f.startswith(tid + "-"))] + seen["variables"]
        return "", (f"{tid} saw {foreign}" if foreign else "")
    if expected is None:
        line = output.strip()
        if not line.startswith(token):
            return f"output of another call: {output[:200]!r}", ""
        tail = line[len(token):].strip()
        if tail != _EXPECTED_TAIL[kind]:
            return "", f"{tid} {kind}: {tail!r}"
    return "", ""


async def soak(calls: int, trajectories: int, size: int, seed: int) -> dict:
    """Run the soak; returns the report (see the module docstring). While it runs, ``tempfile.tempdir`` is a
    fresh directory, so that what the pool leaves on the host can be seen."""
    schedule = plan(calls, trajectories, seed)
    results: dict[tuple[str, int], tuple[str, str | None, bool]] = {}
    unexpected: list[str] = []
    leaks: list[str] = []
    by_kind: dict[str, Counter] = {k: Counter() for k in KINDS}
    saved_tempdir = tempfile.tempdir
    host_dir = Path(tempfile.mkdtemp(prefix="rollopt-soak-"))
    tempfile.tempdir = str(host_dir)  # the pool's directories go here: checked empty after it closes
    started = time.perf_counter()
    try:
        async with SandboxPool(size, LIMITS, max_sessions=trajectories // 2 + 1) as pool:
            async def trajectory(tid: str) -> None:
                session, kinds = schedule[tid]
                for i, kind in enumerate(kinds):
                    token = f"{tid}:{i}"
                    code = KINDS[kind][0].replace("TOKEN", token).replace("TID", tid)
                    timeout = HANG_TIMEOUT_S if kind in ("hang",) else None
                    result = await pool.run(code, session=tid if session else None, timeout_s=timeout)
                    if (tid, i) in results:
                        unexpected.append(f"{token}: a second result")
                    error = result.error.kind if result.error else None
                    results[(tid, i)] = (kind, error, result.restarted)
                    by_kind[kind][str(error)] += 1
                    problem, leak = check(kind, tid, token, session, result.output, error)
                    if problem:
                        unexpected.append(f"{token} {kind}: {problem}")
                    if leak:
                        leaks.append(leak)
                if session:
                    await pool.release(tid)

            async with anyio.create_task_group() as tg:
                for tid in schedule:
                    tg.start_soon(trajectory, tid)
            with anyio.fail_after(120):
                await pool.wait_ready()
            idle, live = pool.idle, len(pool.host_pids())
        elapsed = time.perf_counter() - started
        after = len(pool.host_pids())
        dirs_left = sorted(str(p.relative_to(host_dir)) for p in host_dir.iterdir())
    finally:
        tempfile.tempdir = saved_tempdir
        if host_dir.exists() and not any(host_dir.iterdir()):
            host_dir.rmdir()
    planned = Counter(k for _, kinds in schedule.values() for k in kinds)
    return {
        "benchmark": "sandbox_soak",
        "calls": calls, "trajectories": trajectories, "sessions": sum(s for s, _ in schedule.values()),
        "size": size, "seed": seed, "hang_timeout_s": HANG_TIMEOUT_S,
        "limits": {k: getattr(LIMITS, k) for k in ("timeout_s", "cpu_s", "memory_mb", "max_processes",
                                                   "file_size_mb", "max_output_bytes")},
        "kinds": dict(sorted(planned.items())),
        "time_s": elapsed,
        "results": {
            "calls_answered": len(results),
            "by_kind": {k: dict(v) for k, v in by_kind.items() if v},
            "restarted_session_calls": sum(r[2] for r in results.values()),
            "unexpected": unexpected, "leaks": leaks,
            "idle_at_end": idle, "processes_at_end": live,
            "host_processes_after_close": after, "host_dirs_after_close": dirs_left,
        },
    }


def passed(report: dict, size: int) -> bool:
    r = report["results"]
    return (r["calls_answered"] == report["calls"] and not r["unexpected"] and not r["leaks"]
            and r["idle_at_end"] == size == r["processes_at_end"] and r["host_processes_after_close"] == 0
            and not r["host_dirs_after_close"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--size", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    report = anyio.run(soak, args.calls, args.trajectories, args.size, args.seed)
    report["passed"] = passed(report, args.size)
    report["command"] = " ".join([".venv/bin/python", "bench/sandbox_soak.py"] + sys.argv[1:])
    report["machine"] = {"cores": os.cpu_count(), "platform": platform.platform(),
                         "python": platform.python_version(), "load_avg_1m_at_end": os.getloadavg()[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sandbox-soak.json").write_text(json.dumps(report, indent=2) + "\n")
    r = report["results"]
    print(f"{r['calls_answered']}/{report['calls']} calls answered in {report['time_s']:.0f}s "
          f"({report['trajectories']} trajectories, {report['sessions']} in sessions, pool of {report['size']}); "
          f"{len(r['unexpected'])} unexpected, {len(r['leaks'])} leaks; pool at end {r['idle_at_end']} idle, "
          f"{r['processes_at_end']} processes; after close {r['host_processes_after_close']} processes, "
          f"{len(r['host_dirs_after_close'])} dirs: {'PASSED' if report['passed'] else 'FAILED'}")
    for line in (r["unexpected"] + r["leaks"])[:20]:
        print("  " + line)
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
