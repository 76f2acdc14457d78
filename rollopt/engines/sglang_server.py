"""Launch a real SGLang server process for a local HF model directory, wait until it is healthy, stop it.

``SGLangServer`` is a context manager, sync (``with``) and async (``async with``)::

    with SGLangServer("/path/to/model", extra_args=["--dtype", "float32"]) as server:
        ...  # SGLangEngine(server.base_url)

Contract:

* The server runs from its own virtualenv (default ``<repo>/.venv-sglang``, made by
  ``scripts/setup-sglang-venv.sh`` / ``make sglang-venv``; ``python=`` or ``$ROLLOPT_SGLANG_PYTHON`` override
  it), because sglang's pinned requirements conflict with rollopt's. The supported version is
  ``sglang==0.5.23`` (:data:`SGLANG_VERSION`).
* It is started as ``python -m sglang.launch_server --model-path DIR --host 127.0.0.1 --port P`` plus, on
  ``device="cpu"``, ``--device cpu --disable-overlap-schedule --max-total-tokens 8192`` (without the cap SGLang
  reserves ~15 GB of RAM for KV; a flag in ``extra_args`` replaces its default here, e.g. ``--max-total-tokens
  16384`` for a larger KV pool), ``SGLANG_USE_CPU_ENGINE=1`` and ``PYTHONPATH`` set to the test/CI-only
  ``sgl_kernel`` stand-in (``rollopt/engines/_sgl_kernel_cpu_standin``) for the server process only.
* With no ``port`` given it picks a free one below the kernel's ephemeral range (see :func:`free_port`); if the
  server still fails to bind it (the log says so), it is relaunched on a new port, up to ``bind_retries`` times.
* It streams deltas (``--incremental-streaming-output``) unless ``incremental_stream=False``: SGLang's default
  resends every earlier token and logprob in each chunk, so a request of n tokens costs the server and the client
  O(n²) work; on long answers that is time the rollout waits (the client handles both forms).
* It runs in its own process group (session); stdout and stderr go to a log file (``log_path``).
* Start-up waits for ``GET /health_generate`` to answer 200; if the process exits first or the timeout passes,
  the process group is stopped and :class:`~rollopt.errors.EngineError` is raised with the tail of the log.
* ``stop()`` (also on exit, error or cancellation) sends SIGTERM to the process group, waits, then SIGKILL,
  and always reaps the process. ``kill()`` SIGKILLs the group at once (to test crash handling).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import anyio
import httpx

from rollopt.errors import ConfigError, EngineError

SGLANG_VERSION = "0.5.23"
REPO_ROOT = Path(__file__).resolve().parents[2]
STANDIN_PATH = Path(__file__).resolve().parent / "_sgl_kernel_cpu_standin"
CPU_ARGS = ("--device", "cpu", "--disable-overlap-schedule", "--max-total-tokens", "8192", "--sleep-on-idle")
INCREMENTAL_STREAM_ARG = "--incremental-streaming-output"


def _defaults_not_given(defaults: Sequence[str], given: Sequence[str]) -> list[str]:
    """The ``--flag [value ...]`` groups of ``defaults`` whose flag ``given`` does not name, as ``--flag`` or
    ``--flag=value`` (it replaces them)."""
    named = {arg.split("=", 1)[0] for arg in given if arg.startswith("--")}
    kept: list[str] = []
    keep = True
    for arg in defaults:
        if arg.startswith("--"):
            keep = arg not in named
        if keep:
            kept.append(arg)
    return kept


def default_sglang_python() -> Path:
    """``$ROLLOPT_SGLANG_PYTHON`` if set, else ``<repo>/.venv-sglang/bin/python``."""
    env = os.environ.get("ROLLOPT_SGLANG_PYTHON")
    return Path(env) if env else REPO_ROOT / ".venv-sglang" / "bin" / "python"


PORT_RANGE = (10000, 21999)  # below SGLang's own internal-port range (22000-29999) and the ephemeral range
BIND_FAILURE = "error while attempting to bind on address"


def free_port(host: str = "127.0.0.1", attempts: int = 64) -> int:
    """A port that is free now and outside the kernel's ephemeral range.

    A port from ``bind(0)`` is ephemeral: after it is released, the kernel may hand it to any socket the server's
    own child processes open (gloo, ZMQ, outgoing connections) before the HTTP server binds it. Ports below the
    ephemeral range are only handed out on request, so the race is gone; SGLang uses 22000-29999 for its own
    later-bound ports, so this stays below that too."""
    rng = random.SystemRandom()
    for port in rng.sample(range(PORT_RANGE[0], PORT_RANGE[1] + 1), attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise EngineError(f"no free port in {PORT_RANGE[0]}-{PORT_RANGE[1]} after {attempts} tries; pass port=...")


class _PortTaken(Exception):
    """The server could not bind its HTTP port (someone took it between the check and the bind)."""


class SGLangServer:
    """One SGLang server process; see the module docstring for the contract.

    Args:
        model_dir: a local HF model directory (config.json, safetensors, tokenizer).
        port: the port to listen on (default: a free one).
        python: the interpreter of the SGLang virtualenv (default :func:`default_sglang_python`).
        extra_args: more ``sglang.launch_server`` flags, e.g. ``["--dtype", "float32"]``.
        device: ``"cpu"`` adds the CPU flags and environment described above; anything else is passed as
            ``--device`` with no stand-in.
        log_path: where the server's stdout/stderr go (default: a new file in the temp dir).
        startup_timeout_s: how long to wait for health before giving up.
        bind_retries: when ``port`` was left to the launcher and the server fails to bind it, relaunch on a
            new free port up to this many times (a port given explicitly is never changed).
        stop_timeout_s: how long to wait after SIGTERM before SIGKILL.
        incremental_stream: pass ``--incremental-streaming-output`` (each streamed chunk holds only the new tokens
            and logprobs; see the module docstring).
    """

    def __init__(self, model_dir: str | Path, port: int | None = None, *, python: str | Path | None = None,
                 extra_args: Sequence[str] = (), device: str = "cpu", host: str = "127.0.0.1",
                 log_path: str | Path | None = None, startup_timeout_s: float = 240.0,
                 stop_timeout_s: float = 15.0, bind_retries: int = 3, incremental_stream: bool = True) -> None:
        self.model_dir = Path(model_dir)
        self.host = host
        self.port = port
        self._choose_port = port is None
        self.bind_retries = bind_retries
        self.python = Path(python) if python is not None else default_sglang_python()
        self.extra_args = list(extra_args)
        self.device = device
        self.incremental_stream = incremental_stream
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None  # seconds from spawn to healthy
        self._started_at = 0.0
        self._log_offset = 0  # where this launch's output starts in the log (a relaunch appends)

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the server has no port yet; start it first")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def command(self) -> list[str]:
        args = [str(self.python), "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                "--host", self.host, "--port", str(self.port)]
        if self.device == "cpu":
            args += _defaults_not_given(CPU_ARGS, self.extra_args)
        else:
            args += ["--device", self.device]
        if self.incremental_stream and INCREMENTAL_STREAM_ARG not in self.extra_args:
            args.append(INCREMENTAL_STREAM_ARG)
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = str(STANDIN_PATH)
        return env

    # ------------------------------------------------------------------------------------------ start
    def _spawn(self) -> None:
        if not self.python.exists():
            raise ConfigError(
                f"no SGLang interpreter at {self.python}; run `make sglang-venv` (scripts/setup-sglang-venv.sh) "
                "to create .venv-sglang, or pass python=... / set ROLLOPT_SGLANG_PYTHON")
        if not (self.model_dir / "config.json").exists():
            raise ConfigError(f"model_dir {self.model_dir} has no config.json; give an HF model directory")
        if self._choose_port:
            self.port = free_port(self.host)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"rollopt-sglang-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.environment(),
                                            start_new_session=True)
        self._started_at = time.monotonic()

    def _startup_error(self, why: str) -> EngineError:
        return EngineError(f"SGLang server for {self.model_dir} on port {self.port} {why}; "
                           f"log {self.log_path}, last lines:\n{self.log_tail()}")

    def _poll_once(self, status: int | None) -> bool:
        """True when healthy; raises (after stopping the group) when the process died or time ran out."""
        assert self.process is not None
        if status == 200:
            self.startup_s = time.monotonic() - self._started_at
            return True
        if BIND_FAILURE in self._log_of_this_launch():  # uvicorn logs it and then hangs in shutdown: do not wait it out
            self.stop()
            if self._choose_port:
                raise _PortTaken()
            raise self._startup_error("could not bind its port (in use); pass another port")
        code = self.process.poll()
        if code is not None:
            self.stop()
            raise self._startup_error(f"exited with code {code} during start-up")
        if time.monotonic() - self._started_at > self.startup_timeout_s:
            self.stop()
            raise self._startup_error(f"was not healthy after {self.startup_timeout_s:g} s")
        return False

    def _check_not_started(self) -> None:
        if self.process is not None:
            raise RuntimeError("this SGLangServer was already started")

    def start(self) -> "SGLangServer":
        """Spawn the server and block until it is healthy."""
        self._check_not_started()
        for attempt in range(self.bind_retries + 1):
            self._spawn()
            try:
                with httpx.Client(timeout=30, trust_env=False) as client:
                    while True:
                        try:
                            status = client.get(self.base_url + "/health_generate").status_code
                        except httpx.HTTPError:
                            status = None
                        if self._poll_once(status):
                            return self
                        time.sleep(0.5)
            except _PortTaken:
                if attempt == self.bind_retries:
                    raise self._startup_error(f"could not bind a free port in {attempt + 1} launches") from None
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    async def astart(self) -> "SGLangServer":
        """Spawn the server and wait (without blocking the event loop) until it is healthy; cancellation
        stops it."""
        self._check_not_started()
        for attempt in range(self.bind_retries + 1):
            self._spawn()
            try:
                async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
                    while True:
                        try:
                            status = (await client.get(self.base_url + "/health_generate")).status_code
                        except httpx.HTTPError:
                            status = None
                        if self._poll_once(status):
                            return self
                        await anyio.sleep(0.5)
            except _PortTaken:
                if attempt == self.bind_retries:
                    raise self._startup_error(f"could not bind a free port in {attempt + 1} launches") from None
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(self.stop)
                raise
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------------------ stop
    def _signal_group(self, sig: int) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, sig)  # start_new_session: the group id is the leader's pid
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group now and reap the leader (simulates a crash)."""
        if self.process is None:
            return
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM the process group, wait up to ``stop_timeout_s``, then SIGKILL it; idempotent."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # the leader may be gone while children (scheduler, detokenizer) linger: SIGKILL the group either way
        self._signal_group(signal.SIGKILL)
        self.process.wait()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def _log_of_this_launch(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(self._log_offset, f.tell() - 16 * 1024))
            return f.read().decode("utf-8", "replace")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    # ------------------------------------------------------------------------------------------ context
    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> "SGLangServer":
        return await self.astart()

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.stop)

    def __repr__(self) -> str:
        return f"SGLangServer({str(self.model_dir)!r}, port={self.port}, pid={self.pid}, running={self.running})"


def main_serve(model_dir: str | Path, port: int | None = None, extra_args: Sequence[str] = (),
               python: str | Path | None = None) -> int:
    """Run a server in the foreground until Ctrl-C or SIGTERM (``rollopt serve-sglang``); either stops the
    server's process group before returning. Meant for a CLI's main thread (it installs signal handlers)."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)  # also when started with SIGINT ignored (a background job)
    signal.signal(signal.SIGTERM, interrupt)
    server = SGLangServer(model_dir, port, python=python, extra_args=extra_args)
    print(f"starting SGLang {SGLANG_VERSION} for {model_dir} ...", file=sys.stderr, flush=True)
    try:
        with server:
            print(f"SGLang server ready at {server.base_url} after {server.startup_s:.1f} s "
                  f"(pid {server.pid}, log {server.log_path}); Ctrl-C stops it", flush=True)
            while server.running:
                time.sleep(1.0)
            print(f"the server exited with code {server.process.returncode}; log tail:\n{server.log_tail()}",
                  file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 0
