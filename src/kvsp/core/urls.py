"""One spelling per service URL.

Holders and instances are named by base URLs in records, principals files and links; the same
endpoint written two ways (``HTTP://H:80/kvsp`` and ``http://h/kvsp/``) must compare equal
everywhere a decision depends on it.
"""

from __future__ import annotations

from functools import lru_cache
from urllib.parse import urlsplit, urlunsplit

__all__ = ["canonical_url"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


@lru_cache(maxsize=65_536)
def canonical_url(url: str) -> str:
    """Lowercase scheme and host, no default port, a trailing slash on the path."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    return urlunsplit((scheme, netloc, path, parts.query, ""))
