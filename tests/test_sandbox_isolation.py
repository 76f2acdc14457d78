"""The sandbox pool under hostile programs: what one call can do to the pool, to later calls and to the host.

Each test here failed on the pool before its isolation gaps were closed: a deep directory tree cost a worker
(and then the whole pool), IPC objects and kernel keys outlived their call, memfds and SysV segments held
memory past the per-process limit, namespaces could be created, a thread bomb was an exception and
``sys.exit(5)`` was success.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import secrets
import subprocess
import tempfile
import textwrap
from pathlib import Path

import anyio
import pytest

from rollopt.environments import sandbox
from rollopt.environments.sandbox import MAX_WORKERS, SandboxLimits, SandboxPool

pytestmark = pytest.mark.asyncio  # also when run without the project's pytest settings (asyncio_mode = auto)

LIMITS = SandboxLimits(timeout_s=60.0, cpu_s=10, memory_mb=128, max_processes=6, file_size_mb=16,
                       max_output_bytes=4000)
HANG_GUARD_S = 120  # only against a hang (the bug some of these tests catch), never a performance bound
ROOT = Path(__file__).resolve().parents[1]


def program(source: str) -> str:
    return textwrap.dedent(source).strip() + "\n"


@pytest.fixture(autouse=True)
def remove_deep_trees(tmp_path):
    """pytest deletes old ``tmp_path`` folders with a recursive ``shutil.rmtree``: a deep tree that a failing
    pool left there would break that (and later pytest runs). ``rm -rf`` has no depth limit."""
    yield
    subprocess.run(["rm", "-rf", "--", str(tmp_path)], check=False)


@pytest.fixture
def pool_tmp(tmp_path, monkeypatch):
    """Make the pools of one test keep their host directories in a folder of their own (checked empty after)."""
    pools = tmp_path / "pools"
    pools.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(pools))
    return pools


# ---------------------------------------------------------------------------------------------- cleanup

def deep_tree(canary: Path) -> str:
    """A program that builds what broke cleanup; its links point at ``canary``, a host directory the host's
    cleanup (root, outside the sandbox) would empty if it followed them."""
    return DEEP_TREE.replace("CANARY", str(canary))


DEEP_TREE = program("""
    import os
    for i in range(3000):             # a chain longer than PATH_MAX and deeper than Python's recursion limit
        os.mkdir("d")
        os.chdir("d")
    open("leaf", "w").write("x")
    os.chmod("leaf", 0)
    for i in range(3000):             # on the way up, take away the permissions of some directories
        os.chdir("..")
        if i % 700 == 0:
            os.chmod("d", 0)
    os.symlink("CANARY", "canary")    # cleanup must not follow links out of the scratch directory
    os.symlink("CANARY", "d/canary")
    os.mkdir(".rollopt-rm-1")         # nor trip over names it uses itself
    open(".rollopt-rm-1/f", "w").close()
    print("built")
""")


async def test_a_deep_directory_tree_costs_no_worker_and_leaves_nothing_on_the_host(pool_tmp, tmp_path):
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep").write_text("keep")
    tree = deep_tree(canary)
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(2, LIMITS, max_sessions=2) as pool:
            for _ in range(3):
                result = await pool.run(tree)
                assert result.ok and result.output == "built\n", result
            await pool.wait_ready()
            assert pool.idle == 2 and len(pool.host_pids()) == 2
            assert (await pool.run("import os; print(os.listdir('.'))")).output == "[]\n"
            assert (await pool.run(tree, session="released")).output == "built\n"
            await pool.release("released")  # the host removes this tree
            assert (await pool.run(tree, session="left-open")).output == "built\n"
            await pool.wait_ready()
            assert pool.idle == 2
    assert (canary / "keep").read_text() == "keep"
    assert list(pool_tmp.iterdir()) == []  # every scratch directory and the pool's own are gone
    assert pool.host_pids() == set()


async def test_a_worker_that_cannot_clean_up_is_replaced_and_its_call_keeps_its_result(monkeypatch, pool_tmp):
    """The supervisor's cleanup fails after every call (here: its scratch path is wrong): the reply still
    arrives, and the pool swaps in a fresh worker instead of reusing a dirty one."""
    config = SandboxPool._worker_config
    monkeypatch.setattr(SandboxPool, "_worker_config", lambda self, uid: config(self, uid) | {"scratch": "/nowhere"})
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, LIMITS) as pool:
            before = pool.host_pids()
            for i in range(3):
                result = await pool.run(f"print({i})")
                assert result.ok and result.output == f"{i}\n", result
                await pool.wait_ready()
                assert pool.idle == 1
                now = pool.host_pids()
                assert len(now) == 1 and now != before  # a new supervisor each time
                before = now
    assert list(pool_tmp.iterdir()) == []


async def test_host_cleanup_failures_cost_no_capacity(monkeypatch, pool_tmp):
    """Removing a dead worker's directory fails (as ``shutil.rmtree`` did on a deep tree): the worker is
    still replaced, and the pool's close removes what was left."""
    import shutil
    real_rmtree, real_remove = shutil.rmtree, getattr(sandbox, "remove_tree", None)

    def failing(path, *args, **kwargs):
        if os.path.basename(str(path)).startswith("w"):  # a worker's scratch directory, not the pool's
            raise RecursionError("maximum recursion depth exceeded")
        return (real_remove or real_rmtree)(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", failing)
    monkeypatch.setattr(sandbox, "remove_tree", failing, raising=False)
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, LIMITS, max_sessions=1) as pool:
            for _ in range(3):
                assert (await pool.run("import os; os._exit(1)")).error.kind == "sandbox_crash"
            await pool.run("x = 1", session="s")
            await pool.release("s")
            await pool.wait_ready()
            assert pool.idle == 1 and (await pool.run("print('alive')")).output == "alive\n"
    monkeypatch.undo()
    assert list(pool_tmp.iterdir()) == []


async def test_empty_tree_handles_any_depth_permissions_links_and_its_own_names(tmp_path):
    from rollopt.environments._sandbox_worker import empty_tree
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep")
    root = tmp_path / "root"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY)
    for i in range(5000):  # deeper than PATH_MAX allows as a path: built with directory fds
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = child
        if i % 1000 == 0:
            os.symlink(str(outside), "link", dir_fd=fd)
            os.mkdir(".rollopt-rm-3", dir_fd=fd)
    os.close(fd)
    os.chmod(root / "d", 0)
    (root / ".rollopt-rm-2").write_text("a file named like the temporary names")
    empty_tree(str(root))
    assert list(root.iterdir()) == [] and (outside / "keep").read_text() == "keep"


# ---------------------------------------------------------------------------------------------- IPC, keyring

LEAVE_IPC = program("""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    made = []
    shm = libc.shmget(0x5EC12E7, 4096, 0o1666)
    if shm >= 0:
        address = libc.shmat(shm, None, 0)
        ctypes.memmove(address, b"SECRET-SHM", 10)
        made.append("shm")
    queue = libc.msgget(0x5EC12E8, 0o1666)
    if queue >= 0:
        message = ctypes.create_string_buffer(8 + 10)
        ctypes.memmove(ctypes.addressof(message) + 8, b"SECRET-MSG", 10)
        ctypes.c_long.from_buffer(message).value = 1
        made.append("msg" if libc.msgsnd(queue, message, 10, 0) == 0 else "msg-empty")
    libc.mq_open.restype = ctypes.c_int
    if libc.mq_open(b"/rollopt-secret", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0:
        made.append("mq")
    print(made)
""")
FIND_IPC = program("""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    found = []
    for kind in ("shm", "msg", "sem"):
        if len(open(f"/proc/sysvipc/{kind}").read().splitlines()) > 1:
            found.append(kind + " listed")
    shm = libc.shmget(0x5EC12E7, 0, 0)
    if shm >= 0:
        found.append(ctypes.string_at(libc.shmat(shm, None, 0), 10).decode())
    queue = libc.msgget(0x5EC12E8, 0)
    if queue >= 0:
        found.append("msg queue")
    if libc.mq_open(b"/rollopt-secret", os.O_RDONLY) >= 0:
        found.append("posix mq")
    print(found)
""")


async def test_ipc_objects_do_not_outlive_their_call():
    """SysV shared memory and message queues and POSIX message queues are per IPC namespace (per worker):
    a call cannot create any, so none reaches a later call or a later session on the same worker."""
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, LIMITS, max_sessions=1) as pool:
            assert (await pool.run(LEAVE_IPC)).output == "[]\n"
            assert (await pool.run(FIND_IPC)).output == "[]\n"
            assert (await pool.run(FIND_IPC, session="next-trajectory")).output == "[]\n"


KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}  # add_key, request_key, keyctl


def key_programs() -> tuple[str, str]:
    if platform.machine() not in KEY_SYSCALLS:
        pytest.skip(f"syscall numbers for {platform.machine()} are not listed")
    add_key, request_key, keyctl = KEY_SYSCALLS[platform.machine()]
    leave = program(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        serial = libc.syscall({add_key}, b"user", b"rollopt-secret", b"SECRET-KEY", 10, -4)  # the user keyring
        print("added" if serial > 0 else "refused")
    """)
    find = program(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        serial = libc.syscall({request_key}, b"user", b"rollopt-secret", None, 0)
        buffer = ctypes.create_string_buffer(64)
        if serial > 0 and libc.syscall({keyctl}, 11, serial, buffer, 64) > 0:  # KEYCTL_READ
            print(buffer.value.decode())
        else:
            print("no key")
    """)
    return leave, find


async def test_the_kernel_keyring_is_closed_to_calls():
    """Keys live per uid, not per namespace: they would reach later calls, later pools that reuse the uid,
    and outlive the pool."""
    leave, find = key_programs()
    uid_base = (1 << 24) + secrets.randbelow(1 << 16) * MAX_WORKERS
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, LIMITS, uid_base=uid_base) as pool:
            assert (await pool.run(leave)).output == "refused\n"
            assert (await pool.run(find)).output == "no key\n"
        async with SandboxPool(1, LIMITS, uid_base=uid_base) as pool:
            assert (await pool.run(find)).output == "no key\n"


# ---------------------------------------------------------------------------------------------- memory

HOLD_MEMORY = program("""
    import ctypes, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    chunk = b"x" * (1 << 20)
    held = {"memfd": 0, "sysv": 0}
    fds = []
    try:
        for _ in range(24):                     # 24 x 16 MiB files in memory, none of it mapped
            fd = os.memfd_create("hold")
            fds.append(fd)
            for _ in range(16):
                os.write(fd, chunk)
                held["memfd"] += 1
    except OSError:
        pass
    for _ in range(24):                         # 24 x 16 MiB SysV segments, each mapped only while written
        shm = libc.shmget(0, 16 << 20, 0o1600)
        if shm < 0:
            break
        address = libc.shmat(shm, None, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            break
        ctypes.memset(address, 1, 16 << 20)
        libc.shmdt(ctypes.c_void_p(address))
        held["sysv"] += 16
    pairs, sent = [], 0
    try:
        while sent < (256 << 20):               # kernel buffers of socket pairs (stop at 256 MiB)
            a, b = socket.socketpair()
            pairs.append((a, b))
            try:
                a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            except OSError:
                pass
            a.setblocking(False)
            while True:
                try:
                    sent += a.send(chunk)
                except BlockingIOError:
                    break
    except OSError:                             # out of file descriptors
        pass
    print(held["memfd"], held["sysv"], sent >> 20)
""")


async def test_memory_outside_the_address_space_limit_is_capped():
    limits = SandboxLimits(timeout_s=60.0, cpu_s=10, memory_mb=64, max_processes=6, file_size_mb=16)
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, limits, max_sessions=1) as pool:
            for session in (None, "s"):
                result = await pool.run(HOLD_MEMORY, session=session)
                memfd_mib, sysv_mib, socket_mib = map(int, result.output.split())
                assert memfd_mib < 64 and sysv_mib < 64 and socket_mib < 64, (session, result.output)
            assert (await pool.run(FIND_IPC)).output == "[]\n"  # and no segment outlives its call


# ---------------------------------------------------------------------------------------------- syscalls

PROBE_SYSCALLS = program("""
    import ctypes, os, subprocess, threading
    libc = ctypes.CDLL(None, use_errno=True)
    allowed = []
    if libc.unshare(0x10000000) == 0:                      # CLONE_NEWUSER
        allowed.append("unshare(CLONE_NEWUSER)")
    if libc.unshare(0x08000000) == 0:                      # CLONE_NEWIPC
        allowed.append("unshare(CLONE_NEWIPC)")
    pid = os.fork()
    if pid == 0:                                           # a child, so that a kill stays in it
        os._exit(0 if libc.ptrace(0, 0, None, None) == 0 else 1)   # PTRACE_TRACEME
    if os.waitpid(pid, 0)[1] == 0:
        allowed.append("ptrace")
    if libc.mount(b"none", b"/scratch", b"tmpfs", 0, None) == 0:
        allowed.append("mount")
    # what must keep working under the filter
    box = []
    thread = threading.Thread(target=box.append, args=("thread",))
    thread.start()
    thread.join()
    box.append(subprocess.run(["/bin/echo", "subprocess"], capture_output=True, text=True).stdout.strip())
    box.append(ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(lambda x: x + 1)(41))
    print(allowed, box)
""")


async def test_a_syscall_filter_denies_what_a_tool_never_needs():
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, LIMITS) as pool:
            assert (await pool.run(PROBE_SYSCALLS)).output == "[] ['thread', 'subprocess', 42]\n"
            if platform.machine() == "x86_64":  # clone(CLONE_NEWUSER) as a raw syscall; x32-ABI unshare
                raw = program("""
                    import ctypes, os
                    libc = ctypes.CDLL(None, use_errno=True)
                    child = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)   # clone(CLONE_NEWUSER | SIGCHLD)
                    if child == 0:
                        os._exit(0)
                    print("clone", "allowed" if child > 0 else "denied")
                    pid = os.fork()
                    if pid == 0:
                        os._exit(0 if libc.syscall(0x40000000 | 272, 0x10000000) == 0 else 1)
                    print("x32", "allowed" if os.waitpid(pid, 0)[1] == 0 else "denied")
                """)
                assert (await pool.run(raw)).output == "clone denied\nx32 denied\n"


# ---------------------------------------------------------------------------------------------- results

async def test_a_thread_bomb_is_a_resource_limit():
    bomb = "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(30,)).start()"
    small_stacks = "import threading\nthreading.stack_size(256 << 10)\n" + bomb
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, LIMITS) as pool:  # 6 processes, and room for many small stacks
            assert (await pool.run(small_stacks)).error.kind == "sandbox_processes"
        few_stacks = SandboxLimits(timeout_s=60.0, cpu_s=10, memory_mb=64, max_processes=256)
        async with SandboxPool(1, few_stacks) as pool:  # 64 MiB: room for a few thread stacks only
            assert (await pool.run(bomb)).error.kind == "sandbox_memory"


async def test_a_nonzero_exit_is_an_error():
    with anyio.fail_after(HANG_GUARD_S):
        async with SandboxPool(1, LIMITS, max_sessions=1) as pool:
            five = await pool.run("import sys; sys.exit(5)")
            assert five.error.kind == "sandbox_exit" and five.error.detail["exit_code"] == 5
            message = await pool.run("raise SystemExit('giving up')")
            assert message.error.kind == "sandbox_exit" and message.output == "giving up\n"
            for code in ("import sys; sys.exit()", "import sys; sys.exit(0)", "raise SystemExit(None)"):
                assert (await pool.run(code)).ok
            in_session = await pool.run("x = 7\nimport sys; sys.exit(3)", session="s")
            assert in_session.error.detail["exit_code"] == 3
            assert (await pool.run("print(x)", session="s")).output == "7\n"  # the interpreter lives on


# ---------------------------------------------------------------------------------------------- soak

def load_soak():
    spec = importlib.util.spec_from_file_location("sandbox_soak", ROOT / "bench" / "sandbox_soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_soak_200_mixed_calls_from_concurrent_trajectories(pool_tmp):
    """Good, crashing, hanging and hostile calls from 12 trajectories at once, stateless and in sessions:
    every call gets exactly one result of its expected kind, no trajectory sees another's data, the pool
    ends at full size and nothing stays on the host."""
    soak = load_soak()
    report = await soak.soak(calls=200, trajectories=12, size=3, seed=0)
    assert report["results"]["calls_answered"] == 200, report["results"]
    assert report["results"]["unexpected"] == [], report["results"]["unexpected"][:5]
    assert report["results"]["leaks"] == [], report["results"]["leaks"][:5]
    assert report["results"]["idle_at_end"] == 3 and report["results"]["processes_at_end"] == 3
    assert report["results"]["host_processes_after_close"] == 0
    assert set(report["kinds"]) >= {"ok", "crash", "hang", "deep_tree", "ipc", "memfd", "unshare", "exit"}
    assert list(pool_tmp.iterdir()) == []
