"""``free_port``: ports outside the kernel's ephemeral range (where a client's outgoing
connection could take one before its service binds it), never twice in a process, and a port
someone listens on is passed over."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvsp import local
from kvsp.local import free_port


def _ephemeral() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_ports_are_outside_the_ephemeral_range_and_never_repeat() -> None:
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
    assert not set(ports) & set(_ephemeral())


def test_a_port_someone_listens_on_is_passed_over() -> None:
    walk = local._PortWalk()
    taken = walk._ports[walk._at % len(walk._ports)]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        assert walk.take() != taken


def test_the_wider_stretch_is_chosen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    ranges = tmp_path / "range"
    monkeypatch.setattr(local, "_EPHEMERAL", ranges)
    ranges.write_text("40000\t60999\n")
    assert local._outside_ephemeral() == range(10_000, 40000)
    ranges.write_text("12000\t30000\n")
    assert local._outside_ephemeral() == range(30001, 65536)
    ranges.write_text("1024\t65535\n")
    assert local._outside_ephemeral() == range(1024, 65536)
