"""Real servers for tests: a redis-server on a free port, kvsp services in their own processes,
and ASGI apps served by uvicorn inside the test's event loop."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from uvicorn.config import LifespanType

from kvsp.local import free_port
from kvsp.web.serving import uvicorn_config

__all__ = ["KVSP", "RedisServer", "Service", "free_port", "running", "serving"]

KVSP = Path(sys.executable).with_name("kvsp")


def _wait_for(check: object, what: str, timeout_s: float = 60.0) -> None:
    """Poll until ``check`` holds; only an upper bound (a vLLM instance importing vLLM and torch
    beside another on two busy cores has taken more than 20 s to come up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, httpx.HTTPError):  # not listening yet
            if check():  # type: ignore[operator]
                return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not come up in {timeout_s} s")


class RedisServer:
    """A private redis-server (no persistence) that tests can stop and start again; the
    benchmarks also run Valkey's ``valkey-server`` through it."""

    def __init__(self, port: int | None = None, program: str = "redis-server") -> None:
        binary = shutil.which(program)
        if binary is None:
            raise RuntimeError(f"{program} is not installed; `make test` installs redis-server")
        self.binary = binary
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def _ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for(self._ping, f"redis-server on {self.port}")
        return self

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


class DynamoIndexer:
    """NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``) under ``python``.

    It binds its HTTP port on every interface and has no option to do otherwise, so it runs in a
    network namespace of its own whose only interface is loopback; event publishers reach it on
    IPC sockets, which cross namespaces, and requests reach its port through ``nsenter``."""

    PORT = 8090

    def __init__(self, python: Path, log: Path) -> None:
        self.out = log.open("wb")
        command = f"ip link set lo up && exec {python} -m dynamo.indexer --port {self.PORT}"
        self.process = subprocess.Popen(
            ["unshare", "--net", "sh", "-c", command], stdout=self.out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.call("GET", "health")
                return
            except (ValueError, subprocess.CalledProcessError):
                time.sleep(0.2)
        raise AssertionError("Dynamo's indexer did not start: " + log.read_text()[-2000:])

    def inside(self, argv: list[str], **options: Any) -> subprocess.CompletedProcess[bytes]:
        """Run ``argv`` in the indexer's network namespace (where its port is)."""
        command = ["nsenter", "-t", str(self.process.pid), "-n", *argv]
        return subprocess.run(command, check=True, capture_output=True, **options)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """A request to the indexer, from inside its namespace."""
        url = f"http://127.0.0.1:{self.PORT}/{path}"
        command = ["curl", "-sf", "-X", method, url, "-H", "content-type: application/json"]
        if body is not None:
            command += ["-d", json.dumps(body)]
        out = self.inside(command, timeout=30).stdout
        return json.loads(out) if out.strip() else None

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.out.close()


#: Services start as children of one process that imported kvsp's services (torch and
#: transformers included) once: a fork of it runs the command line, so a service comes up
#: without its seconds of imports. Each is a real process of its own, on its own port, stopped
#: with real signals; ``kvsp up``, ``kvsp demo`` and the CLI tests run ``kvsp`` as users do.
_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["kvsp.cli", "kvsp.instance.app"])
#: services started and not stopped yet
_RUNNING: set[multiprocessing.process.BaseProcess] = set()


@atexit.register  # after multiprocessing's own: this runs first
def _kill_left_over() -> None:
    """A service a failed test left running must not keep the run from ending: at exit the
    interpreter waits for every child process."""
    for process in _RUNNING:
        process.kill()
        process.join()


def _run(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked child: ``kvsp ARGV`` with ``env``, its output to ``log``. (What the
    preloaded modules read from the environment on import, they read in the parent.)"""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for target in (1, 2):
        os.dup2(fd, target)
    os.close(fd)
    from kvsp.cli import main

    main(argv)


class Service:
    """A kvsp service in its own process (``kvsp ARGS...``), stopped with SIGTERM or SIGKILL.
    ``log`` holds what it wrote, once stopped."""

    def __init__(self, *args: str, port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/kvsp/"
        self.args = [*args, "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        self.process: multiprocessing.process.BaseProcess | None = None
        self.log = b""
        self._log: Path | None = None

    def start(self, health: str = "healthz") -> Service:
        fd, name = tempfile.mkstemp(prefix="kvsp-service-", suffix=".log")
        os.close(fd)
        log = self._log = Path(name)
        self.process = _FORKS.Process(target=_run, args=(self.args, self.env, name))
        self.process.start()
        _RUNNING.add(self.process)

        def up() -> bool:
            assert self.process is not None
            if self.process.exitcode is not None:
                raise RuntimeError(f"kvsp {self.args} exited: {log.read_bytes()!r}")
            return httpx.get(self.base_url + health, timeout=1).status_code < 500

        _wait_for(up, "kvsp " + " ".join(self.args))
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.pid is not None:  # it was started
            if self.process.exitcode is None:
                os.kill(self.process.pid, sig)
            self.process.join(15)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
            if self._log is not None:
                self.log = self._log.read_bytes()
                self._log.unlink(missing_ok=True)
            _RUNNING.discard(self.process)
            self.process = None


@contextlib.contextmanager
def running(*things: RedisServer | Service) -> Iterator[None]:
    try:
        for thing in things:
            thing.start()
        yield
    finally:
        for thing in reversed(things):
            thing.stop()


@contextlib.asynccontextmanager
async def serving(app: Any, port: int = 0, lifespan: LifespanType = "on") -> AsyncIterator[str]:
    """``app`` served on loopback as kvsp's services are (a free port unless given), in this
    event loop; yields its base URL."""
    port = port or free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning", lifespan))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/kvsp/"
    finally:
        server.should_exit = True
        await task
