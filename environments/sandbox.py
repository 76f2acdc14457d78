"""A pool of warm, isolated Python workers for tools that run untrusted code.

``SandboxPool`` keeps ``size`` workers started ahead of time, each a bubblewrap (``bwrap``) sandbox holding a
small supervisor (:mod:`rollopt.environments._sandbox_worker`), so the cost of starting a sandbox and an
interpreter is paid once, not per call. A stateless call forks a fresh *runner* from the supervisor, runs the
code under the call's limits and then kills every process it left and empties its scratch directory. A
*session* (``run(code, session=trajectory_id)``) checks a worker out of the pool for one trajectory: one
interpreter keeps its variables and files across that trajectory's calls until :meth:`SandboxPool.release`
kills it; the pool starts a replacement at once, so ``size`` workers stay warm for everyone else.

What is enforced (each has a test in ``tests/test_sandbox.py`` or ``tests/test_sandbox_isolation.py``):

==========================  ===============================================================================
wall-clock timeout          host-side, per call; at the deadline the whole sandbox is killed and replaced
CPU time                    ``RLIMIT_CPU`` per process: per call when stateless, per session in a session
memory                      ``RLIMIT_AS`` (address space) per process; memory that address space does not
                            count is out of reach: memfds, SysV shared memory and message queues, POSIX
                            message queues are denied (syscall filter); no tmpfs is writable; socket buffers
                            stay at the kernel's default size, times ``RLIMIT_NOFILE`` (``max_open_files``)
processes and threads       ``RLIMIT_NPROC``: each worker runs as its own unused uid, so the count is per worker
file size                   ``RLIMIT_FSIZE`` per file written
output                      stdout+stderr share one pipe; the first ``max_output_bytes`` are kept
filesystem                  only ``/usr``, the interpreter's prefix (read-only) and a private ``/scratch``
                            (the only writable place; emptied after each stateless call, whatever tree a call
                            built there: any depth, any permission bits) are visible
network                     a new, empty network namespace (loopback only, not the host's)
processes of other users    a new pid namespace: only the sandbox's own processes are visible
state between calls         nothing outlives a stateless call: its processes are killed, ``/scratch`` emptied,
                            and what would outlive them is denied: IPC objects (they live per IPC namespace,
                            i.e. per worker) and kernel keys (per uid, so across workers, pools and pool
                            close). A session's worker serves only that session until it is released
syscalls                    a seccomp filter (libseccomp, loaded by bwrap) denies what a tool never needs:
                            new namespaces (``unshare``, ``setns``, ``clone`` with namespace flags), mounts,
                            the keyring, IPC objects, memfds, ``ptrace``, ``bpf``, ``perf_event_open``,
                            ``io_uring``, module loading, ``kexec``...; syscalls of another ABI kill the process
privileges                  the supervisor drops root for the worker uid before any untrusted code runs;
                            ``no_new_privs`` is set, so setuid binaries give nothing back
==========================  ===============================================================================

Not enforced: total memory of a call with several processes (the limits are per process; no cgroup is
used), kernel memory in pipe buffers (bounded by the kernel's per-user ``fs.pipe-user-pages-soft``, 64 MiB
per worker by default), total disk use (per-file size only; ``/scratch`` lives on the host's temp
filesystem), CPU shares between workers, the size of the code sent, the kernel attack surface that remains
(the filter is a deny list), and side channels. A program can forge its *own* result (status and output
come from its process), never another call's. The pool must run as root (it creates the per-worker uids' processes) on
Linux with bubblewrap and libseccomp installed; otherwise entering it raises :class:`SandboxUnavailable`
naming the fix.

Cleanup never costs capacity: a worker whose cleanup fails (its supervisor says so, or it dies) is killed
and replaced; removing a dead worker's directory on the host takes no recursion and no long paths, and what
it cannot remove the pool's close removes (or raises about).

Lifecycle: ``async with SandboxPool(...) as pool`` starts the workers (``NEW → OPEN``); leaving the block,
normally, on error or on cancellation, kills every worker and removes every scratch directory (``CLOSED``).
Calls on a pool that is not open raise :class:`PoolStateError`. A call never raises for the program's own
failure: a crash, a hang, a limit hit, a nonzero ``SystemExit`` or cut output is a :class:`SandboxResult` with a
typed ``error`` (``sandbox_exception``, ``sandbox_exit``, ``sandbox_timeout``, ``sandbox_cpu``,
``sandbox_memory``, ``sandbox_processes``, ``sandbox_file_size``, ``sandbox_crash``,
``sandbox_output_truncated``). Cancelling a call kills its worker
(a half-run program cannot be returned to the pool) and re-raises.
"""

from __future__ import annotations

import enum
import errno
import functools
import json
import math
import os
import secrets
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from rollopt.environments._sandbox_worker import remove_tree
from rollopt.errors import ConfigError, ErrorRecord, RolloptError

_WORKER_SCRIPT = Path(__file__).with_name("_sandbox_worker.py")
_START_TIMEOUT_S = 30.0
MAX_WORKERS = 1024
"""Upper bound of ``size + max_sessions``: the number of uids a pool reserves."""


class SandboxUnavailable(RolloptError):
    """The sandbox cannot run here (bubblewrap missing, not root, a worker failed to start)."""


class PoolStateError(RolloptError, RuntimeError):
    """The pool was used outside its ``async with`` block, or entered twice."""


class PoolState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True)
class SandboxLimits:
    """What one call may use.

    Attributes:
        timeout_s: wall-clock deadline of one call (queueing for a free worker not included).
        cpu_s: CPU seconds per process (a session's interpreter is one process for all its calls).
        memory_mb: address space per process, MiB.
        max_processes: processes and threads a call may run at once, its own included.
        file_size_mb: largest file a call may write, MiB.
        max_output_bytes: stdout+stderr bytes kept; the rest is counted and cut.
        max_open_files: file descriptors per process. Each socket can hold up to ``net.core.wmem_default``
            (usually 208 KiB) of kernel buffers that ``memory_mb`` does not count, so this bounds that memory
            too (about 30 MiB per process at 256 on a default kernel; raising socket buffers is denied).
    """

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    max_processes: int = 16
    file_size_mb: int = 16
    max_output_bytes: int = 16_384
    max_open_files: int = 256

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_mb", "max_processes", "file_size_mb", "max_output_bytes",
                     "max_open_files"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)!r}")
        if self.memory_mb < 64:
            raise ConfigError("SandboxLimits.memory_mb must be >= 64: the interpreter alone maps ~30 MiB")


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one call: the program's output (cut to the limit) and, when it failed, a typed error.

    ``restarted`` is true when a session's interpreter had died before this call (its state is gone and the
    call ran in a fresh one)."""

    output: str
    error: ErrorRecord | None = None
    restarted: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class _WorkerLost(Exception):
    """The supervisor stopped answering (it died, or broke the protocol)."""


class _Worker:
    """One running sandbox: the bwrap process, the pipe to its supervisor, its scratch directory."""

    def __init__(self, process: Process, slot: int, scratch: Path, reply_cap: int) -> None:
        assert process.stdin is not None and process.stdout is not None
        self.process, self.slot, self.scratch, self.reply_cap = process, slot, scratch, reply_cap
        self.replies = BufferedByteReceiveStream(process.stdout)
        self.init_pidfd: int | None = None  # the sandbox's pid-namespace init (a pidfd: immune to pid reuse)

    async def call(self, code: str, session: bool) -> dict:
        """Send one request and wait for its reply line; raises :class:`_WorkerLost` if none can come."""
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send(json.dumps({"code": code, "session": session}).encode() + b"\n")
            return json.loads(await self.replies.receive_until(b"\n", self.reply_cap))
        except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.IncompleteRead, anyio.DelimiterNotFound,
                anyio.ClosedResourceError, ValueError) as exc:
            raise _WorkerLost(f"{type(exc).__name__}: {exc}") from exc

    async def kill(self) -> None:
        """Kill the sandbox's namespace init: the kernel kills every process in the namespace before the init
        can be reaped, and bwrap exits only after reaping it, so once bwrap is gone no sandboxed process runs.
        Then delete its scratch directory (whatever tree the program built); if that fails the directory is
        left for the pool's close, which removes the pool's whole directory."""
        with anyio.CancelScope(shield=True):
            if self.init_pidfd is not None:
                try:
                    signal.pidfd_send_signal(self.init_pidfd, signal.SIGKILL)
                except ProcessLookupError:  # it already died
                    pass
                os.close(self.init_pidfd)
                self.init_pidfd = None
            elif self.process.returncode is None:  # the init is not known yet: --die-with-parent kills it
                self.process.kill()
            await self.process.wait()
            await self.process.aclose()
            try:
                await anyio.to_thread.run_sync(remove_tree, str(self.scratch))
            except Exception:  # the pool's close tries again, and raises if the directory still stays
                pass


class SandboxPool:
    """Warm sandboxed Python workers; see the module docstring for what is enforced.

    Args:
        size: workers kept warm for stateless calls and for new sessions.
        limits: per-call limits.
        max_sessions: sessions open at once; opening one more waits for a release.
        bwrap: the bubblewrap executable.
        uid_base: first uid of the ``size + max_sessions`` unused uids the workers run as (default: random,
            so that two pools do not share process counts).
    """

    def __init__(self, size: int = 4, limits: SandboxLimits | None = None, *, max_sessions: int = 64,
                 bwrap: str = "bwrap", uid_base: int | None = None) -> None:
        if size < 1 or max_sessions < 0 or size + max_sessions > MAX_WORKERS:
            raise ConfigError(f"need size >= 1, max_sessions >= 0 and size + max_sessions <= {MAX_WORKERS}")
        self.size, self.max_sessions, self.limits = size, max_sessions, limits or SandboxLimits()
        self.bwrap = bwrap
        self.uid_base = uid_base if uid_base is not None else (1 << 24) + secrets.randbelow(1 << 16) * MAX_WORKERS
        self._state = PoolState.NEW
        self._free_slots = list(range(size + max_sessions))
        self._workers: set[_Worker] = set()
        self._sessions: dict[str, _Worker] = {}
        self._session_locks: dict[str, anyio.Lock] = {}
        self._lost_sessions: set[str] = set()
        self._session_slots = anyio.Semaphore(max_sessions) if max_sessions else None
        self._changed = anyio.Event()

    # ------------------------------------------------------------------------------------------ lifecycle
    @property
    def state(self) -> PoolState:
        return self._state

    @property
    def idle(self) -> int:
        """Warm workers waiting for a call."""
        return self._idle_send.statistics().current_buffer_used if self._state is PoolState.OPEN else 0

    @property
    def sessions(self) -> int:
        """Sessions holding a worker now."""
        return len(self._sessions)

    def host_pids(self) -> set[int]:
        """Host pids of the live (not zombie) processes running under any of this pool's worker uids: what a
        caller checks to see that nothing outlived a call, a session or the pool."""
        low, high = self.uid_base, self.uid_base + self.size + self.max_sessions
        pids = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines()
                                  if ":" in line)
                except OSError:
                    continue
                if low <= int(fields["Uid"].split()[0]) < high and not fields["State"].strip().startswith("Z"):
                    pids.add(int(entry.name))
        return pids

    async def __aenter__(self) -> "SandboxPool":
        if self._state is not PoolState.NEW:
            raise PoolStateError(f"a SandboxPool is entered once; this one is {self._state.value}")
        _check_host(self.bwrap)
        self._seccomp = _seccomp_program()
        assert len(self._seccomp) < 65536, "the filter must fit in a pipe's buffer"
        self._dir = Path(tempfile.mkdtemp(prefix="rollopt-sandbox-"))
        self._idle_send, self._idle_recv = anyio.create_memory_object_stream[_Worker](math.inf)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._state = PoolState.OPEN
        failures: list[SandboxUnavailable] = []

        async def start_one() -> None:
            try:
                await self._add_worker()
            except SandboxUnavailable as exc:
                failures.append(exc)

        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.size):
                    tg.start_soon(start_one)
            if failures:
                raise failures[0]
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._state in (PoolState.CLOSING, PoolState.CLOSED):
            return
        self._state = PoolState.CLOSING
        self._tg.cancel_scope.cancel()  # replacements still starting
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            await self._close_all()

    async def _close_all(self) -> None:
        with anyio.CancelScope(shield=True):
            self._idle_send.close()
            self._idle_recv.close()
            try:
                for worker in list(self._workers):
                    await self._drop(worker)
            finally:
                self._state = PoolState.CLOSED
                self._notify()
                await anyio.to_thread.run_sync(remove_tree, str(self._dir))  # raises if a directory stays

    async def wait_ready(self) -> None:
        """Wait until ``size`` warm workers are idle (e.g. after failures, for their replacements)."""
        self._check_open()
        while self.idle < self.size:
            await self._changed.wait()
            self._check_open()

    # ------------------------------------------------------------------------------------------ calls
    async def run(self, code: str, *, session: str | None = None, timeout_s: float | None = None) -> SandboxResult:
        """Run ``code`` (a Python program) and return its output or typed error.

        Without ``session`` the program runs in a fresh process and leaves nothing behind. With a session id,
        it runs in that session's interpreter (started on first use), which keeps its state until
        :meth:`release`. Calls of one session run one at a time, in arrival order.
        """
        self._check_open()
        timeout = self.limits.timeout_s if timeout_s is None else timeout_s
        if session is None:
            worker = await self._take_idle()
            result = await self._call(worker, code, False, timeout)
            if worker in self._workers:
                self._idle_send.send_nowait(worker)
                self._notify()
            return result
        lock = self._session_locks.setdefault(session, anyio.Lock())
        async with lock:
            self._check_open()
            worker = self._sessions.get(session) or await self._open_session(session)
            result = await self._call(worker, code, True, timeout)
            if session in self._lost_sessions and not result.restarted:
                result = SandboxResult(result.output, result.error, restarted=True)
                self._lost_sessions.discard(session)
            if worker not in self._workers:  # the worker died with this call: the next call starts afresh
                del self._sessions[session]
                self._lost_sessions.add(session)
                self._release_session_slot()
            return result

    async def release(self, session: str) -> None:
        """End a session: kill its interpreter and everything it started. Unknown ids are ignored."""
        lock = self._session_locks.get(session)
        if lock is None:
            return
        async with lock:
            worker = self._sessions.pop(session, None)
            self._lost_sessions.discard(session)
            if worker is not None:
                await self._drop(worker)
                self._release_session_slot()
        self._session_locks.pop(session, None)

    # ------------------------------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self._state is not PoolState.OPEN:
            raise PoolStateError(f"the SandboxPool is {self._state.value}; use it inside `async with SandboxPool()`")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _take_idle(self) -> _Worker:
        try:
            return await self._idle_recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise PoolStateError("the SandboxPool closed while this call waited for a worker") from None

    async def _open_session(self, session: str) -> _Worker:
        if self._session_slots is None:
            raise PoolStateError("this SandboxPool has max_sessions=0; create it with max_sessions > 0")
        await self._session_slots.acquire()
        try:
            worker = await self._take_idle()
        except BaseException:
            self._session_slots.release()
            raise
        self._sessions[session] = worker
        self._tg.start_soon(self._replace)  # the pool stays at ``size`` warm workers
        return worker

    def _release_session_slot(self) -> None:
        assert self._session_slots is not None
        self._session_slots.release()

    async def _call(self, worker: _Worker, code: str, session: bool, timeout: float) -> SandboxResult:
        """One request with a deadline. A worker that timed out, died or was cancelled is dropped (and, if it
        was a pool worker, replaced)."""
        try:
            with anyio.move_on_after(timeout) as scope:
                reply = await worker.call(code, session)
        except _WorkerLost as exc:
            await self._drop(worker, replace=not session)
            if self._state is not PoolState.OPEN:
                raise PoolStateError("the SandboxPool closed while this call ran") from None
            return SandboxResult("", ErrorRecord("sandbox_crash", f"the sandbox died: {exc}"))
        except BaseException:
            await self._drop(worker, replace=not session)
            raise
        if scope.cancelled_caught:
            await self._drop(worker, replace=not session)
            message = f"the program ran past its {timeout:g}s deadline; its sandbox was killed"
            return SandboxResult("", ErrorRecord("sandbox_timeout", message, {"timeout_s": timeout}))
        if reply.get("retire"):  # it could not clean up after the call: a fresh sandbox takes its place
            await self._drop(worker, replace=not session)
        return _result(reply, self.limits)

    async def _drop(self, worker: _Worker, replace: bool = False) -> None:
        """Kill ``worker`` and free its slot; start a replacement if asked (and the pool is open)."""
        if worker not in self._workers:
            return
        self._workers.discard(worker)
        try:
            await worker.kill()
        finally:  # whatever killing it did, the pool keeps its capacity
            self._free_slots.append(worker.slot)
            if replace and self._state is PoolState.OPEN:
                self._tg.start_soon(self._replace)
            self._notify()

    async def _replace(self) -> None:
        """Start one worker; a failure (e.g. the machine is out of memory) is retried after a pause."""
        while True:
            try:
                return await self._add_worker()
            except SandboxUnavailable:
                await anyio.sleep(1.0)

    async def _add_worker(self) -> None:
        slot = self._free_slots.pop(0)
        uid = self.uid_base + slot
        scratch = Path(tempfile.mkdtemp(prefix=f"w{slot}-", dir=self._dir))
        os.chown(scratch, uid, uid)
        info_r, info_w = os.pipe()
        filter_r, filter_w = os.pipe()
        try:
            try:
                os.write(filter_w, self._seccomp)  # under a KiB: the pipe holds it until bwrap reads it
            finally:
                os.close(filter_w)
            with anyio.CancelScope(shield=True):  # a process started but not handed back would leak
                command = _command(self.bwrap, scratch, info_w, filter_r, self._worker_config(uid))
                process = await anyio.open_process(command, pass_fds=(info_w, filter_r), start_new_session=True)
        except BaseException:
            self._free_slots.append(slot)
            os.close(info_r)
            remove_tree(str(scratch))
            raise
        finally:
            os.close(info_w)
            os.close(filter_r)
        reply_cap = 6 * self.limits.max_output_bytes + 4096
        worker = _Worker(process, slot, scratch, reply_cap)
        self._workers.add(worker)
        try:
            with anyio.fail_after(_START_TIMEOUT_S):
                worker.init_pidfd = os.pidfd_open(await anyio.to_thread.run_sync(_read_init_pid, info_r))
                ready = await worker.replies.receive_until(b"\n", 4096)
            if json.loads(ready) != {"status": "ready"}:
                raise ValueError(ready)
        except Exception as exc:
            stderr = await _read_stderr(process)
            await self._drop(worker)
            raise SandboxUnavailable(f"a sandbox worker failed to start ({type(exc).__name__}: {exc}); "
                                     f"bwrap said: {stderr or '(nothing)'}") from None
        except BaseException:
            await self._drop(worker)
            raise
        finally:
            os.close(info_r)
        self._idle_send.send_nowait(worker)
        self._notify()

    def _worker_config(self, uid: int) -> dict:
        limits = self.limits
        return {"uid": uid, "cpu_s": limits.cpu_s, "memory_bytes": limits.memory_mb << 20,
                "file_size_bytes": limits.file_size_mb << 20, "max_processes": limits.max_processes,
                "max_open_files": limits.max_open_files, "max_output_bytes": limits.max_output_bytes,
                "scratch": "/scratch"}


def _check_host(bwrap: str) -> None:
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable("the sandbox needs Linux namespaces (bubblewrap); this is " + sys.platform)
    if shutil.which(bwrap) is None:
        raise SandboxUnavailable(f"bubblewrap ({bwrap!r}) is not installed; install it with "
                                 "`apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`")
    if os.geteuid() != 0:
        raise SandboxUnavailable("the sandbox pool must run as root: each worker runs under its own unused uid "
                                 "so that process limits are per worker")


# Syscalls a tool never needs, denied (EPERM) to everything in the sandbox by the filter bwrap loads before
# it starts the supervisor. Grouped by what they would give a program.
_DENIED_SYSCALLS = (
    # new namespaces, mounts, a way out of the sandbox's own namespaces
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick",
    "move_mount", "open_tree", "mount_setattr", "open_by_handle_at",
    # state that outlives a call, or memory outside RLIMIT_AS: the kernel keyring (per uid, not per namespace),
    # SysV IPC and POSIX message queues (per IPC namespace, i.e. per worker, not per call), memfds
    "keyctl", "add_key", "request_key", "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv",
    "msgctl", "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend",
    "mq_timedreceive", "mq_notify", "mq_getsetattr", "memfd_create", "memfd_secret",
    # other processes' memory, and kernel attack surface no tool uses
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "bpf", "perf_event_open",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "lookup_dcookie", "uselib",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm", "vhangup", "settimeofday", "clock_settime",
    "clock_adjtime",
)
# clone() with a namespace flag is unshare() by another name (its flags are argument 0 on x86-64 and arm64).
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                          0x00000080)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
# Growing a socket's buffers past the kernel's default: kernel memory that RLIMIT_AS does not count.
_SOL_SOCKET = 1
_SOCKET_BUFFER_OPTIONS = (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_SNDBUFFORCE, SO_RCVBUFFORCE


@functools.cache
def _seccomp_program() -> bytes:
    """The BPF program bwrap loads (``--seccomp FD``), built by libseccomp: allow by default; deny
    :data:`_DENIED_SYSCALLS`, namespace-making ``clone`` and growing socket buffers with EPERM; answer
    ``clone3`` (whose flags sit in memory a filter cannot read) with ENOSYS so that libc falls back to
    ``clone``; kill a process that makes a syscall of another ABI (e.g. i386 or x32 on x86-64), which the
    rules do not cover."""
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError) as exc:  # RuntimeError: libseccomp.so.2 is missing
        raise SandboxUnavailable(f"the sandbox's syscall filter needs libseccomp and pyseccomp ({exc}); install "
                                 "them with `apt-get install -y libseccomp2` and `pip install pyseccomp`") from None
    program = seccomp.SyscallFilter(seccomp.ALLOW)
    program.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    for name in _DENIED_SYSCALLS:
        if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) != -1:  # -1: this libseccomp does not know it
            program.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for flag in _CLONE_NAMESPACE_FLAGS:
        program.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    program.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for option in _SOCKET_BUFFER_OPTIONS:
        program.add_rule(seccomp.ERRNO(errno.EPERM), "setsockopt", seccomp.Arg(1, seccomp.EQ, _SOL_SOCKET),
                         seccomp.Arg(2, seccomp.EQ, option))
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        return out.read()


def _command(bwrap: str, scratch: Path, info_fd: int, seccomp_fd: int, config: dict) -> list[str]:
    """The bwrap command line of one worker: new pid/net/ipc/uts namespaces, the syscall filter read from
    ``seccomp_fd``, a read-only /usr and interpreter prefix, a private writable /scratch, nothing else of the
    host's filesystem."""
    python = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    args = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox", "--info-fd", str(info_fd),
            "--seccomp", str(seccomp_fd), "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/lib", "/lib32", "/lib64", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not prefix.startswith("/usr/"):  # bwrap makes missing parents 0700: unreadable once root is dropped
        parents = [str(p) for p in reversed(Path(prefix).parents) if str(p) != "/"]
        args += [a for p in parents for a in ("--perms", "0755", "--dir", p)] + ["--ro-bind", prefix, prefix]
    args += ["--ro-bind", str(_WORKER_SCRIPT), "/sandbox/worker.py", "--bind", str(scratch), "/scratch",
             "--proc", "/proc", "--dev", "/dev", "--chdir", "/scratch", "--clearenv",
             "--setenv", "HOME", "/scratch", "--setenv", "TMPDIR", "/scratch", "--setenv", "PATH", "/usr/bin:/bin",
             "--", python, "-I", "/sandbox/worker.py", json.dumps(config)]
    return args


def _read_init_pid(fd: int) -> int:
    """The host pid of the sandbox's init, from bwrap's ``--info-fd`` JSON (written as the sandbox starts)."""
    data = b""
    while True:
        chunk = os.read(fd, 4096)
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except ValueError:
            if not chunk:
                raise


async def _read_stderr(process: Process) -> str:
    if process.stderr is None:
        return ""
    with anyio.move_on_after(1.0):
        try:
            return (await process.stderr.receive(4096)).decode(errors="replace").strip()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
    return ""


_KINDS = {"exception": "sandbox_exception", "exit": "sandbox_exit", "memory": "sandbox_memory",
          "file_size": "sandbox_file_size", "processes": "sandbox_processes", "cpu": "sandbox_cpu",
          "crash": "sandbox_crash"}


def _result(reply: dict, limits: SandboxLimits) -> SandboxResult:
    """Turn the supervisor's reply into a result; unknown statuses count as crashes."""
    output, omitted, status = str(reply.get("output", "")), int(reply.get("omitted", 0)), reply.get("status")
    exit_code = int(reply.get("exit_code", 0))
    if omitted:
        output += f"\n[... {omitted} more bytes of output cut: the limit is {limits.max_output_bytes} bytes]"
    messages = {
        "exception": "the program raised an exception (the traceback is in the output)",
        "exit": f"the program exited with status {exit_code} (SystemExit)",
        "memory": f"the program ran out of memory (limit {limits.memory_mb} MiB per process)",
        "file_size": f"the program wrote a file past the {limits.file_size_mb} MiB limit",
        "processes": f"the program tried to run more than {limits.max_processes} processes and threads",
        "cpu": f"the program used up its {limits.cpu_s}s of CPU time",
        "crash": "the program's process died before it finished (a signal, os._exit, or a broken runtime)",
    }
    restarted = bool(reply.get("restarted", False))
    if status == "ok" and not omitted:
        return SandboxResult(output, None, restarted)
    if status == "ok":
        error = ErrorRecord("sandbox_output_truncated", f"the output exceeded {limits.max_output_bytes} bytes; "
                            f"{omitted} bytes were cut", {"omitted_bytes": omitted})
    else:
        kind = _KINDS.get(str(status), "sandbox_crash")
        details = {"omitted_bytes": omitted} | ({"exit_code": exit_code} if kind == "sandbox_exit" else {})
        error = ErrorRecord(kind, messages[kind.removeprefix("sandbox_")], details)
    return SandboxResult(output, error, restarted)
