"""Records for index tests."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from kvsp.core.records import InstanceStatusRecord, ReplicaRecord, ReplicaRef

COMPAT = "c0" * 32
SCOPE_A = "a1" * 16
SCOPE_B = "b2" * 16
H1 = "http://127.0.0.1:9101/kvsp/"
H2 = "http://127.0.0.1:9102/kvsp/"
I1 = "http://127.0.0.1:9201/kvsp/"
I2 = "http://127.0.0.1:9202/kvsp/"
LAYERS = 4
LAYER_OCTETS = 1000


def key(n: int) -> str:
    return hashlib.sha256(b"block %d" % n).hexdigest()


def keys(*ns: int) -> list[str]:
    return [key(n) for n in ns]


def replica(
    n: int, holder: str = H1, scope: str = SCOPE_A, ttl_ms: int = 60_000, **changes: Any
) -> ReplicaRecord:
    doc: dict[str, Any] = {
        "block_key": key(n),
        "compat_id": COMPAT,
        "scope_id": scope,
        "holder": holder,
        "codec": 1,
        "size": 20 + 16 * LAYERS + LAYERS * LAYER_OCTETS,
        "digest": "sha-256:" + hashlib.sha256(b"%d" % n).hexdigest(),
        "residency": [{"tier": "host", "layers": [0, LAYERS - 1]}],
        "ttl_ms": ttl_ms,
    }
    doc.update(changes)
    return ReplicaRecord.parse(doc)


def ref(n: int, holder: str = H1, scope: str = SCOPE_A) -> ReplicaRef:
    return ReplicaRef.parse(
        {"compat_id": COMPAT, "scope_id": scope, "block_key": key(n), "holder": holder}
    )


def status(
    instance: str = I1,
    epoch: int = 1,
    links: list[dict[str, Any]] | None = None,
    ttl_ms: int = 60_000,
    prefill: float = 400,
    **changes: Any,
) -> InstanceStatusRecord:
    return InstanceStatusRecord.parse(
        {
            "instance": instance,
            "epoch": epoch,
            "state": "active",
            "running": 0,
            "queued": 0,
            "batch_size": 8,
            "kv_utilization": 0.1,
            "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": 15,
            "links": links if links is not None else [],
            "ttl_ms": ttl_ms,
            **changes,
        }
    )


def namespace(*fields: bytes) -> str:
    """A ``moqt_namespace``: five Track Namespace Fields, each after its length octet."""
    raw = b"".join(bytes([len(f)]) + f for f in fields)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


#: the namespaces of two MOQT publishers behind one relay
RELAY = "moqt://relay.example:4443/"
NAMESPACE_A = namespace(b"kvsp", b"v1", b"compat", b"scope", b"publisher-a")
NAMESPACE_B = namespace(b"kvsp", b"v1", b"compat", b"scope", b"publisher-b")


def principals_toml() -> str:
    """Principals of index tests: holder h1 (scope A), controllers for A and B, instance i1,
    and a metrics scraper."""
    from kvsp.auth import token_sha256

    return f"""
[principals.h1]
token_sha256 = "{token_sha256("h1")}"
roles = ["holder"]
holders = ["{H1}"]
scopes = ["{SCOPE_A}"]

[principals.pc]
token_sha256 = "{token_sha256("pc")}"
roles = ["controller"]
scopes = ["{SCOPE_A}"]

[principals.other-tenant-pc]
token_sha256 = "{token_sha256("pc-b")}"
roles = ["controller"]
scopes = ["{SCOPE_B}"]

[principals.scraper]
token_sha256 = "{token_sha256("scraper")}"
roles = ["metrics"]

[principals.i1]
token_sha256 = "{token_sha256("i1")}"
roles = ["instance"]
holders = ["{I1}"]
scopes = ["{SCOPE_A}"]

[principals.moqt-a]
token_sha256 = "{token_sha256("moqt-a")}"
roles = ["holder"]
holders = ["moqt-namespace:{NAMESPACE_A}"]
scopes = ["{SCOPE_A}"]

[principals.moqt-b]
token_sha256 = "{token_sha256("moqt-b")}"
roles = ["holder"]
holders = ["moqt-namespace:{NAMESPACE_B}"]
scopes = ["{SCOPE_A}"]
"""
