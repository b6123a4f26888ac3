"""kvsp: the KV Cache Storage Protocol and session-aware KV cache management.

The flat public API is the protocol surface: Compatibility Descriptors and IDs (KVSP 4.1),
Scope IDs and Block Keys (4.2), the KV Block Container (4.3), the records (4.4, 6), the error
tree with its problem types, and the clients of the Index Service and of holders. The pure core
behind it lives in ``kvsp.core``; services, the engine and the simulator build on it. The
clients are loaded on first use, so ``import kvsp`` (or any pure module) loads no HTTP library.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvsp.core.compat import CompatibilityDescriptor, compute_compat_id, model_digest
from kvsp.core.container import Container, layer_digest, replica_digest
from kvsp.core.ids import parse_block_key, parse_compat_id, parse_scope_id
from kvsp.core.keys import BlockKeyChain, block_keys, scope_id
from kvsp.core.problems import (
    AlreadyStored,
    CapacityExhausted,
    ConfigurationError,
    ContainerError,
    DescriptorError,
    DigestError,
    Forbidden,
    IllegalTransition,
    InstanceFailed,
    InvalidInput,
    KeyMaterialError,
    KvspError,
    LayersUnavailable,
    LeaseQuotaExceeded,
    MethodNotAllowed,
    NotAccepting,
    NotFound,
    NotLeader,
    PayloadTooLarge,
    RecordError,
    ServiceUnavailable,
    StaleEpoch,
    Unauthenticated,
)
from kvsp.core.records import (
    InstanceStatusRecord,
    LeaseGrant,
    LeaseRequest,
    LookupRequest,
    LookupResponse,
    PrefetchDirective,
    PrefetchStatus,
    ReplicaRecord,
    ReplicaRef,
    Sampler,
    SessionCheckpoint,
    ShardMap,
)

if TYPE_CHECKING:
    from kvsp.holder.client import HolderClient
    from kvsp.index.client import IndexClient

__all__ = [
    "AlreadyStored",
    "BlockKeyChain",
    "CapacityExhausted",
    "CompatibilityDescriptor",
    "ConfigurationError",
    "Container",
    "ContainerError",
    "DescriptorError",
    "DigestError",
    "Forbidden",
    "HolderClient",
    "IllegalTransition",
    "IndexClient",
    "InstanceFailed",
    "InstanceStatusRecord",
    "InvalidInput",
    "KeyMaterialError",
    "KvspError",
    "LayersUnavailable",
    "LeaseGrant",
    "LeaseQuotaExceeded",
    "LeaseRequest",
    "LookupRequest",
    "LookupResponse",
    "MethodNotAllowed",
    "NotAccepting",
    "NotFound",
    "NotLeader",
    "PayloadTooLarge",
    "PrefetchDirective",
    "PrefetchStatus",
    "RecordError",
    "ReplicaRecord",
    "ReplicaRef",
    "Sampler",
    "ServiceUnavailable",
    "SessionCheckpoint",
    "ShardMap",
    "StaleEpoch",
    "Unauthenticated",
    "__version__",
    "block_keys",
    "compute_compat_id",
    "layer_digest",
    "model_digest",
    "parse_block_key",
    "parse_compat_id",
    "parse_scope_id",
    "replica_digest",
    "scope_id",
]

__version__ = "0.1.0"

#: names loaded on first use (they bring an HTTP client with them)
_CLIENTS = {"HolderClient": "kvsp.holder.client", "IndexClient": "kvsp.index.client"}


def __getattr__(name: str) -> Any:
    module = _CLIENTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
