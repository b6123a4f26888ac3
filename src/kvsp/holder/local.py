"""Holders running in this process, by URL, so that a client in the same process (the vLLM
connector of the vLLM-backed instance, which loads from that instance's own holder) reads their
blocks without a loopback HTTP round trip and a second pass of digests. A client that finds no
holder here, or a block not all in host memory, fetches over HTTP as from any holder."""

from __future__ import annotations

from kvsp.core.urls import canonical_url
from kvsp.holder.service import HolderService

__all__ = ["find", "register", "unregister"]

_HOLDERS: dict[str, HolderService] = {}


def register(holder: HolderService) -> None:
    _HOLDERS[canonical_url(holder.url)] = holder


def unregister(holder: HolderService) -> None:
    if _HOLDERS.get(canonical_url(holder.url)) is holder:
        del _HOLDERS[canonical_url(holder.url)]


def find(url: str) -> HolderService | None:
    return _HOLDERS.get(canonical_url(url))
