"""The supervisor that runs inside one sandbox (stdlib only; :mod:`rollopt.environments.sandbox` starts it as
``python -I /sandbox/worker.py CONFIG_JSON`` under bubblewrap and talks to it over stdin/stdout).

It never runs untrusted code itself. At start it drops root for the worker's own uid (so the kernel counts
RLIMIT_NPROC per worker), then serves one request per line on stdin and answers one JSON line on stdout:

* request ``{"code": str, "session": bool}``;
* reply ``{"status": STATUS, "output": str, "omitted": int, "restarted": bool}`` where ``STATUS`` is one of
  ``ok``, ``exception``, ``memory``, ``file_size``, ``processes``, ``cpu``, ``crash``.

Each stateless call runs in a forked *runner* with the call's rlimits; when it ends, every other process of
the worker's uid is killed and the scratch directory is emptied, so nothing of one call reaches the next. A
session keeps one runner (a persistent interpreter) across calls until the host kills the whole sandbox.
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
_REPORTED = {"ok", "exception", "memory", "file_size", "processes"}


def _confine(cfg: dict) -> None:
    """A fresh runner's limits (inherited by whatever it starts)."""
    cpu, mem, fsize = cfg["cpu_s"], cfg["memory_bytes"], cfg["file_size_bytes"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["max_processes"] + 1,) * 2)  # +1: the supervisor's uid too
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _classify(exc: BaseException) -> str:
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:  # RLIMIT_FSIZE
        return "file_size"
    if isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:  # fork under RLIMIT_NPROC
        return "processes"
    return "exception"


def _read_exact(fd: int, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _runner(ctl: int, status: int, persistent: bool) -> None:
    """The runner's loop: read code, run it in one namespace, report a status frame; once unless persistent."""
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
        except SystemExit:
            pass
        except BaseException as exc:  # the program's own failure is its output
            outcome = _classify(exc)
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
                _runner(3, 4, persistent)
            finally:
                os._exit(0)
        for fd in (out_w, ctl_r, status_w, devnull):
            os.close(fd)
        self.out = out_r
        self.pidfd = os.pidfd_open(self.pid)
        os.set_blocking(self.out, False)
        os.set_blocking(self.status, False)

    def call(self, code: str, max_output: int) -> tuple[str, bytes, int]:
        """Send ``code``; collect output until a status frame arrives or the runner exits."""
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
                    return (frame if frame in _REPORTED else "crash"), bytes(output), omitted
            if self.pidfd in ready:
                omitted = _drain(self.out, output, omitted, max_output)
                return self._exit_status(), bytes(output), omitted

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


def _empty(directory: str) -> None:
    """Delete everything under ``directory``; the program may have made a directory unreadable (its owner,
    this uid, can undo that)."""
    os.chmod(directory, 0o700)
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            _empty(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)


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
        status, output, omitted = runner.call(request["code"], cfg["max_output_bytes"])
        if persistent and status not in {"crash", "cpu"} and runner.pid:
            session, lost = runner, False
        else:
            runner.close()
            session, lost = None, persistent
            _empty(cfg["scratch"])
        replies.write(json.dumps({"status": status, "output": output.decode(errors="replace"), "omitted": omitted,
                                  "restarted": restarted}) + "\n")


if __name__ == "__main__":
    main()
