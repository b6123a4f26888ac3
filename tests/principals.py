"""Principals files for tests: each principal's token is its own name."""

from __future__ import annotations

import json
from collections.abc import Sequence

from kvsp.auth import token_sha256


def principal(
    name: str,
    roles: Sequence[str],
    holders: Sequence[str] = (),
    scopes: Sequence[str] = ("*",),
) -> str:
    """One ``[principals.NAME]`` table whose bearer token is ``name``."""
    return (
        f"[principals.{name}]\n"
        f'token_sha256 = "{token_sha256(name)}"\n'
        f"roles = {json.dumps(list(roles))}\n"
        f"holders = {json.dumps(list(holders))}\n"
        f"scopes = {json.dumps(list(scopes))}\n"
    )
