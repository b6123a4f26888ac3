"""A whole kvsp cluster on this machine: an Index Service, a controller with the OpenAI-compatible
front end, a holder that keeps a copy of every block (so a session outlives its instance), and
inference instances, each a separate process on loopback. With ``controllers`` > 1 the
controllers share their state in a ``redis-server`` of the cluster's own (one leads, the others
stand by), and the front end runs on its own before them, so a controller's death cuts no
stream.

``LocalCluster`` writes what the services need into its folder (a principals file with one token
per service and one for the operator, a tenants file with one tenant and its API key, the token
files), starts the processes, waits until each answers ``healthz``, and stops them all: SIGTERM,
then SIGKILL for any that has not exited after a grace period, so no process is left behind.
``kvsp up`` runs one until Ctrl-C; ``kvsp demo`` runs a workload on one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from kvsp.auth import token_sha256
from kvsp.core.keys import scope_id
from kvsp.core.problems import ServiceUnavailable
from kvsp.model import installed, system_prefix
from kvsp.tenants import Tenants

__all__ = ["LocalCluster", "Process", "free_port"]


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise ServiceUnavailable("redis-server is not installed (`make setup` installs it)")
    return found


#: the tenants ``kvsp up`` makes: try one against the other
TENANTS = ("demo", "other")


#: the kernel's ephemeral range: an outgoing connection takes its local port from it, so a port
#: picked there may be taken by some client between being handed out and being bound
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000


def _outside_ephemeral() -> range:
    """The larger stretch of ports outside the ephemeral range (all unprivileged ones where that
    range covers them)."""
    try:
        low, high = map(int, _EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    below, above = range(_LOWEST, low), range(high + 1, 65536)
    widest = max(below, above, key=len)
    return widest if len(widest) else range(1024, 65536)


class _PortWalk:
    """Hands out loopback ports in order from a random start: processes that pick at once (test
    workers, ``kvsp up``) walk different stretches, and no port comes twice in one process."""

    def __init__(self) -> None:
        self._ports = _outside_ephemeral()
        self._at = secrets.randbelow(len(self._ports))

    def take(self) -> int:
        for _ in range(len(self._ports)):
            port = self._ports[self._at % len(self._ports)]
            self._at += 1
            with socket.socket() as probe, contextlib.suppress(OSError):
                probe.bind(("127.0.0.1", port))
                return port
        raise ServiceUnavailable("no free loopback port")


_WALK = _PortWalk()


def free_port() -> int:
    """A loopback port nobody listens on, outside the kernel's ephemeral range."""
    return _WALK.take()


@dataclass
class Process:
    name: str
    args: list[str]
    port: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    #: a program that is not kvsp (``redis-server``): run as it is, and probed by ``PING``
    program: str | None = None

    @property
    def url(self) -> str:
        if self.program is not None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"http://127.0.0.1:{self.port}/kvsp/"

    def start(self) -> None:
        out = self.log.open("ab")
        command = (
            [sys.executable, "-m", "kvsp", *self.args, "--port", str(self.port)]
            if self.program is None
            else [self.program, *self.args, "--port", str(self.port)]
        )
        # a session of its own: a Ctrl-C in the terminal reaches ``kvsp up``, which then stops
        # every process in order, instead of each child on its own
        self.popen = subprocess.Popen(  # noqa: S603 - our own command line, no shell
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

    def healthy(self) -> bool:
        if self.program is not None:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1) as probe,
            ):
                probe.sendall(b"PING\r\n")
                return probe.recv(16).startswith(b"+PONG")
            return False
        try:
            return httpx.get(self.url + "healthz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class LocalCluster:
    folder: Path
    instances: int = 2
    controller_port: int | None = None
    #: controllers sharing one state (in a redis-server of the cluster's); 1: in memory
    controllers: int = 1
    #: per instance: G1 blocks and G2 bytes
    g1_blocks: int = 256
    g2_bytes: str = "1G"
    status_ttl_ms: int = 3_000
    #: the holder that keeps a copy of every block, so sessions outlive their instance
    holder_bytes: str = "2G"
    processes: list[Process] = field(default_factory=list)
    #: each tenant's API key; every tenant has a scope of its own, so no two share a cache
    api_keys: dict[str, str] = field(
        default_factory=lambda: {name: "sk-kvsp-" + secrets.token_hex(16) for name in TENANTS}
    )
    operator_token: str = field(default_factory=lambda: secrets.token_hex(24))
    #: a scraper's token: ``GET metrics`` on every service, nothing else
    metrics_token: str = ""
    #: each tenant's Scope ID (not a secret: it names the scope, it cannot key blocks)
    scope_ids: dict[str, str] = field(default_factory=dict)
    #: a system prompt every tenant shares the blocks of (a shared scope, KVSP 4.2)
    shared_system: str | None = None
    #: the Compatibility ID of the model the instances serve
    compat_id: str = ""
    #: how instances publish vLLM-format KV events: on loopback TCP ports, on IPC sockets in
    #: the cluster's folder, or not at all
    kv_events: Literal["tcp", "ipc"] | None = "tcp"
    #: each instance's KV event endpoints (its PUB socket, its replay socket)
    kv_event_endpoints: list[tuple[str, str]] = field(default_factory=list)
    #: the TTL of the instances' records: how long the IS may name blocks of a dead process
    record_ttl_ms: int = 600_000
    #: the router's token: ``POST query`` on the controller, nothing else
    router_token: str = field(default_factory=lambda: secrets.token_hex(24))

    @property
    def api_key(self) -> str:
        """The first tenant's API key (the one ``kvsp demo`` and the quick start use)."""
        return self.api_keys[TENANTS[0]]

    # -- files -----------------------------------------------------------------------------------

    def _write(self, name: str, text: str) -> Path:
        """A file only its owner may read: every file here holds a secret."""
        path = self.folder / name
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
        path.chmod(0o600)  # a file that was there before keeps its mode through O_TRUNC
        return path

    def prepare(self) -> None:
        """Ports, tokens, the principals and tenants files, and the process list."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        files = installed()
        compat = self.compat_id = files.compat_id.hex()
        index_port = free_port()
        holder_port = free_port()
        holder_url = f"http://127.0.0.1:{holder_port}/kvsp/"
        controller_ports = [self.controller_port or free_port()]
        controller_ports += [free_port() for _ in range(self.controllers - 1)]
        controller_urls = [f"http://127.0.0.1:{p}/kvsp/" for p in controller_ports]
        ports = [free_port() for _ in range(self.instances)]
        urls = [f"http://127.0.0.1:{p}/kvsp/" for p in ports]
        tokens = {
            name: secrets.token_hex(24)
            for name in ["controller", "holder", "metrics", "frontend", *map(str, ports)]
        }
        scope_keys = {name: secrets.token_hex(32) for name in self.api_keys}
        self.scope_ids = {n: scope_id(bytes.fromhex(k)).hex() for n, k in scope_keys.items()}
        shared_key = secrets.token_hex(32)
        shared = [] if self.shared_system is None else [scope_id(bytes.fromhex(shared_key)).hex()]
        scopes = [*self.scope_ids.values(), *shared]
        # each service only the roles its routes need, in the tenants' scopes (docs/api.md)
        principals = [
            self._principal("operator", self.operator_token, ["admin"], ["*"], ["*"]),
            self._principal("controller", tokens["controller"], ["controller"], urls, scopes),
            self._principal("holder", tokens["holder"], ["holder"], [holder_url], scopes),
            self._principal("metrics", tokens["metrics"], ["metrics"], [], []),
            self._principal("router", self.router_token, ["router"], [], scopes),
            self._principal("frontend", tokens["frontend"], ["frontend"], [], scopes),
            *(
                self._principal(f"instance-{p}", tokens[str(p)], ["instance"], [u], scopes)
                for p, u in zip(ports, urls, strict=True)
            ),
        ]
        self.metrics_token = tokens["metrics"]
        auth = str(self._write("principals.toml", "\n".join(principals)))
        tenants_text = "\n".join(
            f'[tenants.{name}]\nscope_key = "{scope_keys[name]}"\n'
            f'compat_ids = ["{compat}"]\napi_keys_sha256 = ["{token_sha256(key)}"]\n'
            for name, key in self.api_keys.items()
        )
        if self.shared_system is not None:  # every tenant shares the system prompt's blocks
            tenants_text += (
                f'\n[shared.system-prompt]\nscope_key = "{shared_key}"\n'
                f"tenants = {json.dumps(list(self.api_keys))}\n"
                f"prefix_system = {json.dumps(self.shared_system)}\n"
            )
        tenants = str(self._write("tenants.toml", tenants_text))
        # the holder and the IS get the tenants' quotas by Scope ID, never their keys
        parsed = Tenants.parse(tenants_text, system_prefix(files))
        quotas = str(self._write("quotas.toml", parsed.quotas.to_toml()))
        controller_token = str(self._write("controller.token", tokens["controller"]))
        holder_token = str(self._write("holder.token", tokens["holder"]))
        logs = self.folder / "logs"
        logs.mkdir(exist_ok=True)
        # the IS knows the model's descriptor from the start, so lookups get estimates
        descriptors = str(self._write("descriptors.json", files.descriptor.canonical().decode()))
        index = Process(
            "index", ["index", "serve", "--auth", auth, "--quotas", quotas, "--descriptors",
                      descriptors, "--log-level", "warning"], index_port, logs / "index.log",
        )  # fmt: skip
        several = self.controllers > 1
        state: list[Process] = []
        if several:  # durable: an acknowledged checkpoint outlives a Redis crash too
            state = [Process("redis", ["--bind", "127.0.0.1", "--save", "", "--appendonly",
                                       "yes", "--appendfsync", "always", "--dir",
                                       str(self.folder)],
                             free_port(), logs / "redis.log", program=_redis_server())]  # fmt: skip
        common = ["controller", "serve", "--tenants", tenants, "--index", index.url, "--auth",
                  auth, "--index-token-file", controller_token, "--instance-token-file",
                  controller_token, "--log-level", "warning"]  # fmt: skip
        controllers = [
            Process("controller", [*common, "--frontend"], controller_ports[0],
                    logs / "controller.log")
        ]  # fmt: skip
        if several:
            controllers = [
                Process(f"controller-{n}", [*common, "--state", state[0].url, "--url", url],
                        port, logs / f"controller-{n}.log")
                for n, (port, url) in enumerate(zip(controller_ports, controller_urls, strict=True))
            ]  # fmt: skip
        fronts: list[Process] = []
        if several:
            frontend_token = str(self._write("frontend.token", tokens["frontend"]))
            choices = [x for u in controller_urls for x in ("--controller", u)]
            fronts = [Process(
                "frontend",
                ["frontend", "serve", "--tenants", tenants, "--token-file", frontend_token,
                 "--auth", auth, "--log-level", "warning", *choices],
                free_port(), logs / "frontend.log",
            )]  # fmt: skip
        holder = Process(
            "holder",
            ["holder", "serve", "--url", holder_url, "--host-bytes", self.holder_bytes, "--index",
             index.url, "--index-token-file", holder_token, "--auth", auth, "--quotas", quotas,
             "--log-level", "warning"],
            holder_port, logs / "holder.log",
        )  # fmt: skip
        self.processes = [*state, index, *controllers, holder]
        self.kv_event_endpoints = (
            [] if self.kv_events is None else [self._kv_events(n) for n in range(self.instances)]
        )
        for n, (port, url) in enumerate(zip(ports, urls, strict=True)):
            token = str(self._write(f"instance-{n}.token", tokens[str(port)]))
            events = (
                []
                if self.kv_events is None
                else ["--kv-events", self.kv_event_endpoints[n][0],
                      "--kv-events-replay", self.kv_event_endpoints[n][1]]
            )  # fmt: skip
            self.processes.append(
                Process(
                    f"instance-{n}",
                    [
                        "instance",
                        "serve",
                        "--url",
                        url,
                        "--tenants",
                        tenants,
                        "--auth",
                        auth,
                        "--controller",
                        ",".join(controller_urls),
                        "--index",
                        index.url,
                        "--token-file",
                        token,
                        "--offload",
                        holder.url,
                        "--session-index",
                        "--g1-blocks",
                        str(self.g1_blocks),
                        "--g2-bytes",
                        self.g2_bytes,
                        "--status-ttl-ms",
                        str(self.status_ttl_ms),
                        "--record-ttl-ms",
                        str(self.record_ttl_ms),
                        *events,
                        "--threads",
                        "1",
                        "--log-level",
                        "warning",
                    ],
                    port,
                    logs / f"instance-{n}.log",
                )
            )
        self.processes += fronts
        self._write("cluster.json", json.dumps(self.describe(), indent=2))

    def _kv_events(self, n: int) -> tuple[str, str]:
        """Instance ``n``'s KV event endpoints: its PUB socket and its replay socket."""
        if self.kv_events == "ipc":
            return (
                f"ipc://{self.folder}/kv-events-{n}.pub",
                f"ipc://{self.folder}/kv-events-{n}.replay",
            )
        return (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")

    @staticmethod
    def _principal(
        name: str, token: str, roles: list[str], holders: list[str], scopes: list[str]
    ) -> str:
        return (
            f'[principals."{name}"]\ntoken_sha256 = "{token_sha256(token)}"\n'
            f"roles = {json.dumps(roles)}\nholders = {json.dumps(holders)}\n"
            f"scopes = {json.dumps(scopes)}\n"
        )

    # -- running ---------------------------------------------------------------------------------

    def _named(self, prefix: str) -> list[Process]:
        return [p for p in self.processes if p.name.split("-")[0] == prefix]

    @property
    def index(self) -> Process:
        return self._named("index")[0]

    @property
    def controller_processes(self) -> list[Process]:
        return self._named("controller")

    @property
    def controller(self) -> Process:
        """The first controller (the only one, unless several share a state)."""
        return self.controller_processes[0]

    @property
    def frontend(self) -> Process:
        """Where the OpenAI-compatible API is served: a front end of its own before several
        controllers, else the controller."""
        return (self._named("frontend") or [self.controller])[0]

    @property
    def redis(self) -> Process | None:
        return next(iter(self._named("redis")), None)

    @property
    def holder(self) -> Process:
        return self._named("holder")[0]

    @property
    def instance_processes(self) -> list[Process]:
        return self._named("instance")

    @property
    def cluster_page(self) -> str:
        """The live cluster page's URL, with the operator's token in its fragment (which the
        browser keeps to itself)."""
        return f"{self.controller.url}ui/#token={self.operator_token}"

    def describe(self) -> dict[str, object]:
        return {
            "index": self.index.url,
            "controller": self.controller.url,
            "controllers": [p.url for p in self.controller_processes],
            "state": "memory" if self.redis is None else self.redis.url,
            "holder": self.holder.url,
            "openai_base_url": self.frontend.url + "v1",
            "cluster_page": self.cluster_page,
            "instances": [p.url for p in self.instance_processes],
            "api_key": self.api_key,
            "api_keys": self.api_keys,
            "operator_token": self.operator_token,
            "metrics_token": self.metrics_token,
            "router_token": self.router_token,
            "kv_events": [
                {"instance": p.url, "endpoint": e, "replay_endpoint": r}
                for p, (e, r) in zip(self.instance_processes, self.kv_event_endpoints, strict=True)
            ]
            if self.kv_events is not None
            else [],
            "logs": str(self.folder / "logs"),
        }

    def start(self, timeout_s: float = 120.0) -> None:
        """Start every process and wait until each is healthy and every instance active."""
        if not self.processes:
            self.prepare()
        try:
            for process in self.processes:
                process.start()
                self._healthy(process, timeout_s)
            self.wait_active(len(self.instance_processes), timeout_s)
            described = {**self.describe(), "pids": self.pids()}
            self._write("cluster.json", json.dumps(described, indent=2))
        except BaseException:
            self.stop()
            raise

    def _healthy(self, process: Process, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not process.alive():
                tail = process.log.read_text(errors="replace")[-2000:]
                raise ServiceUnavailable(f"{process.name} exited at start:\n{tail}")
            if process.healthy():
                return
            time.sleep(0.1)
        raise ServiceUnavailable(f"{process.name} did not answer within {timeout_s} s")

    def view(self) -> list[dict[str, object]]:
        """The leading controller's view of the instances (none while none leads)."""
        for controller in self.controller_processes:
            try:
                answer = httpx.get(
                    controller.url + "instances",
                    headers={"authorization": f"Bearer {self.operator_token}"},
                    timeout=5,
                )
            except httpx.TransportError:
                continue
            if answer.status_code == 200:
                instances: list[dict[str, object]] = answer.json()["instances"]
                return instances
        return []

    def wait_active(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sum(1 for i in self.view() if i["state"] == "active") >= count:
                return
            time.sleep(0.1)
        raise ServiceUnavailable(f"fewer than {count} instances became active")

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to every process still running, then SIGKILL to any left after ``grace_s``."""
        for process in reversed(self.processes):
            if process.alive() and process.popen is not None:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes:
            if process.popen is None:
                continue
            try:
                process.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.popen.pid, signal.SIGKILL)
                process.popen.wait()

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.processes if p.popen is not None]
