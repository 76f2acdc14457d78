"""The supervisor that runs inside one sandbox (stdlib only; :mod:`rollopt.environments.sandbox` starts it as
``python -I /sandbox/worker.py CONFIG_JSON`` under bubblewrap and talks to it over stdin/stdout).

It never runs untrusted code itself. At start it drops root for the worker's own uid (so the kernel counts
RLIMIT_NPROC per worker), then serves one request per line on stdin and answers one JSON line on stdout:

* request ``{"code": str, "session": bool}``;
* reply ``{"status": STATUS, "output": str, "omitted": int, "restarted": bool, "exit_code": int,
  "retire": bool}`` where ``STATUS`` is one of ``ok``, ``exception``, ``exit`` (``SystemExit`` with a nonzero
  code), ``memory``, ``file_size``, ``processes``, ``cpu``, ``crash``.

Each stateless call runs in a forked *runner* with the call's rlimits; when it ends, every other process of
the worker's uid is killed and the scratch directory is emptied, so nothing of one call reaches the next. A
session keeps one runner (a persistent interpreter) across calls until the host kills the whole sandbox. If
emptying the scratch directory fails, the reply says ``retire`` and the supervisor exits after sending it:
the host replaces the whole sandbox rather than reuse a dirty one. (The seccomp filter the host gives bwrap
leaves a call no other state that outlives it: no SysV IPC, POSIX message queues or keyring.)
The runner's stdout and stderr share one pipe; the supervisor keeps the first ``max_output_bytes`` and counts
the rest (``omitted``). What a runner reports about itself is only as trustworthy as the code it ran.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import resource
import select
import signal
import struct
import sys
import time
import traceback

_HEADER = struct.Struct("!I")
_STATUS_CAP = 1 << 16
_REPORTED = {"ok", "exception", "exit", "memory", "file_size", "processes"}


def _confine(cfg: dict) -> None:
    """A fresh runner's limits (inherited by whatever it starts)."""
    cpu, mem, fsize = cfg["cpu_s"], cfg["memory_bytes"], cfg["file_size_bytes"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_processes"] + 1,) * 2)  # +1: the supervisor's uid too
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["max_open_files"],) * 2)  # also bounds socket buffers


def _classify(exc: BaseException, max_tasks: int) -> str:
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:  # RLIMIT_FSIZE
        return "file_size"
    if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:  # fork under RLIMIT_NPROC
        return "processes"
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):  # EAGAIN from pthread_create:
        return "processes" if _tasks_of_my_uid() >= max_tasks else "memory"  # RLIMIT_NPROC, or no room for a stack
    return "exception"


def _tasks_of_my_uid() -> int:
    """Threads of this uid in the sandbox (RLIMIT_NPROC counts threads, the supervisor's included)."""
    uid, count = os.getuid(), 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass
    return count


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _runner(ctl: int, status: int, persistent: bool, max_tasks: int) -> None:
    """The runner's loop: read code, run it in one namespace, report a status frame (``exit N`` for a nonzero
    ``SystemExit``); once unless persistent."""
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
    namespace: dict = {"__name__": "__main__", "__builtins__": __builtins__}
    while True:
        header = _read_exact(ctl, _HEADER.size)
        if header is None:
            return
        code = _read_exact(ctl, _HEADER.unpack(header)[0]).decode()
        outcome = "ok"
        try:
            exec(compile(code, "<sandbox>", "exec"), namespace)
        except SystemExit as exc:  # as the interpreter does: None and 0 succeed, other objects are printed
            code_ = exc.code
            if code_ is not None and not isinstance(code_, int):
                sys.stderr.write(f"{code_}\n")
                code_ = 1
            if code_:
                outcome = f"exit {code_}"
        except BaseException as exc:  # the program's own failure is its output
            outcome = _classify(exc, max_tasks)
            try:  # the traceback without this function's frame
                traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
            except BaseException:
                sys.stderr.write(f"{type(exc).__name__}\n")
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        frame = outcome.encode()
        os.write(status, _HEADER.pack(len(frame)) + frame)
        if not persistent:
            return


class _Runner:
    """The supervisor's handle on one forked runner and the pipes to it."""

    def __init__(self, cfg: dict, persistent: bool) -> None:
        self.cpu_limit = float(cfg["cpu_s"])
        out_r, out_w = os.pipe()
        ctl_r, self.ctl = os.pipe()
        self.status, status_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY)
        self.pid = os.fork()
        if self.pid == 0:
            try:  # lift the fds above 0..4 first, so placing one cannot clobber another
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (devnull, out_w, out_w, ctl_r, status_w)]
                for target, fd in enumerate(high):
                    os.dup2(fd, target)
                os.closerange(5, 1 << 16)
                _confine(cfg)
                _runner(3, 4, persistent, cfg["max_processes"] + 1)
            finally:
                os._exit(0)
        for fd in (out_w, ctl_r, status_w, devnull):
            os.close(fd)
        self.out = out_r
        self.pidfd = os.pidfd_open(self.pid)
        os.set_blocking(self.out, False)
        os.set_blocking(self.status, False)

    def call(self, code: str, max_output: int) -> tuple[str, int, bytes, int]:
        """Send ``code``; collect output until a status frame arrives or the runner exits. Returns the status
        (a word of ``_REPORTED``, ``cpu`` or ``crash``), the exit code (of ``exit``), the output and the count
        of bytes cut from it."""
        data = code.encode()
        try:
            os.write(self.ctl, _HEADER.pack(len(data)) + data)
        except BrokenPipeError:  # the runner is gone; its pidfd says so below
            pass
        output, omitted, status = bytearray(), 0, b""
        while True:
            ready, _, _ = select.select([self.out, self.status, self.pidfd], [], [])
            if self.out in ready:
                omitted = _drain(self.out, output, omitted, max_output)
            if self.status in ready:
                status += _read_some(self.status)
                frame = _frame(status)
                if frame is not None:
                    omitted = _drain(self.out, output, omitted, max_output)
                    return (*_parse(frame), bytes(output), omitted)
            if self.pidfd in ready:
                omitted = _drain(self.out, output, omitted, max_output)
                return self._exit_status(), 0, bytes(output), omitted

    def _exit_status(self) -> str:
        """The runner exited without a status frame: out of CPU time, or it crashed."""
        _, wait_status, usage = os.wait4(self.pid, 0)
        self.pid = 0
        sig = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else 0
        cpu_used = usage.ru_utime + usage.ru_stime
        return "cpu" if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= self.cpu_limit) else "crash"

    def close(self) -> None:
        """Kill the runner and every other process of this uid, then close the pipes."""
        _kill_all()
        for fd in (self.out, self.ctl, self.status, self.pidfd):
            os.close(fd)


def _frame(data: bytes) -> str | None:
    """The status word of a complete frame (a runner writes it in one atomic pipe write), else None."""
    if len(data) < _HEADER.size:
        return None
    size = _HEADER.unpack(data[:_HEADER.size])[0]
    if len(data) < _HEADER.size + size:
        return None
    return data[_HEADER.size:_HEADER.size + size].decode(errors="replace")


def _parse(frame: str) -> tuple[str, int]:
    """A status frame's word and exit code; a frame the program forged into nonsense counts as a crash."""
    word, _, code = frame.partition(" ")
    if word not in _REPORTED:
        return "crash", 0
    if word != "exit":
        return word, 0
    try:
        return "exit", max(-(1 << 31), min(int(code[:12]), (1 << 31) - 1)) or 1
    except ValueError:
        return "exit", 1


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, _STATUS_CAP)
    except BlockingIOError:
        return b""


def _drain(fd: int, output: bytearray, omitted: int, cap: int) -> int:
    """Read what the pipe holds now: keep up to ``cap`` bytes in ``output``; return the new omitted count."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return omitted
        if not chunk:
            return omitted
        room = max(cap - len(output), 0)
        output += chunk[:room]
        omitted += len(chunk) - min(len(chunk), room)


def _kill_all() -> None:
    """SIGKILL every process this uid may signal in the sandbox's pid namespace (all but pid 1 and us) and wait
    until each is reaped (our runner by us, orphans by pid 1), so nothing of a call runs, or counts against the
    next call's process limit, once its reply is sent."""
    me = os.getpid()
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not [pid for pid in os.listdir("/proc") if pid.isdigit() and int(pid) not in (1, me)]:
            return
        time.sleep(0.001)


def empty_tree(root: str) -> None:
    """Delete everything under ``root`` (``root`` itself stays), whatever tree a program built there.

    No recursion and no path longer than one name: each directory is first moved up to ``root`` (renamed),
    then emptied one level, so any depth takes a loop, not a stack, and at most two directory fds are open.
    Permission bits the program took away are given back first (its owner, this uid, may; the host is root).
    Run it only when nothing else writes under ``root``. Also used by the host on a dead sandbox's scratch."""
    top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    serial = 0
    try:
        os.fchmod(top, 0o700)
        while True:
            dirs = []
            with os.scandir(top) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        dirs.append(entry.name)
                    else:
                        os.unlink(entry.name, dir_fd=top)
            if not dirs:
                return
            for name in dirs:
                os.chmod(name, 0o700, dir_fd=top)
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    with os.scandir(fd) as entries:
                        children = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
                    for child, is_dir in children:
                        if not is_dir:
                            os.unlink(child, dir_fd=fd)
                            continue
                        os.chmod(child, 0o700, dir_fd=fd)  # moving a directory to a new parent needs write access
                        while True:
                            serial += 1
                            try:
                                os.rename(child, f".rollopt-rm-{serial}", src_dir_fd=fd, dst_dir_fd=top)
                                break
                            except OSError as exc:  # the name is taken by the program's own entry: the next one
                                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                                    raise
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)


def remove_tree(path: str) -> None:
    """Delete ``path`` and everything under it (see :func:`empty_tree`); a missing path is not an error."""
    try:
        empty_tree(path)
    except FileNotFoundError:
        return
    os.rmdir(path)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])  # every capability is gone from here on
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    session: _Runner | None = None
    lost = False
    replies.write('{"status": "ready"}\n')
    for line in sys.stdin:
        request = json.loads(line)
        persistent = bool(request["session"])
        runner = session if persistent and session is not None else _Runner(cfg, persistent)
        restarted = persistent and session is None and lost
        status, exit_code, output, omitted = runner.call(request["code"], cfg["max_output_bytes"])
        retire = False
        if persistent and status not in {"crash", "cpu"} and runner.pid:
            session, lost = runner, False
        else:
            runner.close()
            session, lost = None, persistent
            try:
                empty_tree(cfg["scratch"])
            except Exception as exc:  # e.g. a disk error: the host replaces this sandbox and its directory
                retire = True
                sys.stderr.write(f"cleanup failed: {type(exc).__name__}: {exc}\n")
        replies.write(json.dumps({"status": status, "output": output.decode(errors="replace"), "omitted": omitted,
                                  "restarted": restarted, "exit_code": exit_code, "retire": retire}) + "\n")
        if retire:
            return


if __name__ == "__main__":
    main()
