"""One exception tree for every kvsp failure, each mapped to an RFC 9457 problem document.

Why one tree: adapters (HTTP services, the CLI, clients) translate errors at their edge and
never swallow them. A caller that wants to treat "anything the peer got wrong" alike catches
``InvalidInput``; one that cares about a single condition catches its class. Each class names
a stable problem type (a slug registered in docs/decisions/0003-problem-types.md) and the HTTP
status it maps to, so a server never has to invent a status or string-match a message.

::

    KvspError                               500 kvsp-internal
     +-- InvalidInput                       400 kvsp-invalid-input
     |    +-- DescriptorError               400 kvsp-invalid-descriptor
     |    +-- KeyMaterialError              400 kvsp-invalid-key-material  (scope keys, tokens, ids)
     |    +-- RecordError                   400 kvsp-invalid-record
     |    +-- ContainerError                400 kvsp-invalid-container
     |    |    +-- ContainerHeaderError         magic, version, flags, codec, counts
     |    |    +-- ContainerLengthError         section lengths vs header / geometry / size limit
     |    |    +-- ContainerTruncatedError      fewer octets than the header announces
     |    |    +-- ContainerTrailingDataError   more octets than the header announces
     |    |    +-- LayerRangeError              a requested layer range outside the container
     |    +-- DigestError                   400 kvsp-digest-mismatch  (Repr-Digest, layer, replica)
     |    +-- ConfigurationError            400 kvsp-invalid-configuration  (principals, tenants)
     +-- Unauthenticated                    401 kvsp-unauthenticated
     +-- Forbidden                          403 kvsp-forbidden
     +-- NotFound                           404 kvsp-not-found
     |    +-- LayersUnavailable             404 kvsp-layers-unavailable
     +-- MethodNotAllowed                   405 kvsp-method-not-allowed
     +-- RequestTimeout                     408 kvsp-request-timeout  (head or body too slow)
     +-- StaleEpoch                         409 kvsp-stale-epoch
     +-- IllegalTransition                  409 kvsp-illegal-transition
     |    +-- InstanceFailed                409 kvsp-instance-failed  (rejoin with a new epoch)
     |    +-- NotAccepting                  409 kvsp-not-accepting  (draining or asleep)
     +-- AlreadyStored                      412 kvsp-already-stored
     +-- PayloadTooLarge                    413 kvsp-payload-too-large
     +-- UriTooLong                         414 kvsp-uri-too-long
     +-- UnsupportedMediaType               415 kvsp-unsupported-media-type
     +-- HeaderFieldsTooLarge               431 kvsp-header-fields-too-large
     +-- LeaseQuotaExceeded                 429 kvsp-lease-quota
     +-- ServiceUnavailable                 503 kvsp-unavailable  (a backing store is down)
     |    +-- PeerError                         a peer failed us (the transport branch)
     |         +-- PeerUnreachable              no connection (refused, reset, no route)
     |         +-- PeerTimeout                  no complete answer within the time allowed
     |         +-- PeerProtocolError            an answer that breaks HTTP/1.1, or broke off
     |              +-- PeerAnswerTooLarge      a body above what the caller may receive
     +-- CapacityExhausted                  507 kvsp-capacity
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "PROBLEM_TYPE_BASE",
    "AlreadyStored",
    "CapacityExhausted",
    "ConfigurationError",
    "ContainerError",
    "ContainerHeaderError",
    "ContainerLengthError",
    "ContainerTrailingDataError",
    "ContainerTruncatedError",
    "DescriptorError",
    "DigestError",
    "Forbidden",
    "HeaderFieldsTooLarge",
    "IllegalTransition",
    "InstanceFailed",
    "InvalidInput",
    "KeyMaterialError",
    "KvspError",
    "LayerRangeError",
    "LayersUnavailable",
    "LeaseQuotaExceeded",
    "MethodNotAllowed",
    "NotAccepting",
    "NotFound",
    "NotLeader",
    "NotReady",
    "PayloadTooLarge",
    "PeerAnswerTooLarge",
    "PeerError",
    "PeerProtocolError",
    "PeerTimeout",
    "PeerUnreachable",
    "PreconditionRequired",
    "RecordError",
    "RequestTimeout",
    "ServiceUnavailable",
    "StaleEpoch",
    "Unauthenticated",
    "UnsupportedMediaType",
    "UriTooLong",
    "problem_types",
]

#: Problem type URIs follow RFC 9457's registry convention: the slug is a fragment of the
#: HTTP Problem Types registry page, so ``type`` is stable and resolvable.
PROBLEM_TYPE_BASE = "https://iana.org/assignments/http-problem-types#"


class KvspError(Exception):
    """Base of every kvsp error; carries what an RFC 9457 problem document needs."""

    status: ClassVar[int] = 500
    slug: ClassVar[str] = "kvsp-internal"
    title: ClassVar[str] = "Internal error"

    def __init__(self, detail: str, **extensions: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extensions = extensions

    @classmethod
    def type_uri(cls) -> str:
        return PROBLEM_TYPE_BASE + cls.slug

    def to_problem(self, instance: str | None = None) -> dict[str, Any]:
        """The RFC 9457 document (``application/problem+json``) for this error."""
        doc: dict[str, Any] = {
            "type": self.type_uri(),
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        if instance is not None:
            doc["instance"] = instance
        doc.update(self.extensions)
        return doc


class InvalidInput(KvspError):
    status = 400
    slug = "kvsp-invalid-input"
    title = "Invalid input"


class DescriptorError(InvalidInput):
    slug = "kvsp-invalid-descriptor"
    title = "Invalid Compatibility Descriptor"


class KeyMaterialError(InvalidInput):
    slug = "kvsp-invalid-key-material"
    title = "Invalid scope key, token or identifier"


class RecordError(InvalidInput):
    slug = "kvsp-invalid-record"
    title = "Invalid record"


class ContainerError(InvalidInput):
    slug = "kvsp-invalid-container"
    title = "Invalid KV Block Container"


class ContainerHeaderError(ContainerError):
    """Magic, version, flags, codec or counts in the fixed header are wrong."""


class ContainerLengthError(ContainerError):
    """Section lengths disagree with each other, the geometry, or a size limit."""


class ContainerTruncatedError(ContainerError):
    """The input ended before the octets the header announces."""


class ContainerTrailingDataError(ContainerError):
    """The input holds octets after the last section the header announces."""


class LayerRangeError(ContainerError):
    """A requested layer range is empty or outside the container's layers."""


class DigestError(InvalidInput):
    slug = "kvsp-digest-mismatch"
    title = "Digest missing, malformed or mismatched"


class ConfigurationError(InvalidInput):
    slug = "kvsp-invalid-configuration"
    title = "Invalid configuration file"


class Unauthenticated(KvspError):
    status = 401
    slug = "kvsp-unauthenticated"
    title = "Unknown or missing credentials"


class Forbidden(KvspError):
    status = 403
    slug = "kvsp-forbidden"
    title = "Not authorized"


class NotFound(KvspError):
    status = 404
    slug = "kvsp-not-found"
    title = "Not found"


class LayersUnavailable(NotFound):
    slug = "kvsp-layers-unavailable"
    title = "Requested layers not held"


class MethodNotAllowed(KvspError):
    status = 405
    slug = "kvsp-method-not-allowed"
    title = "Method not allowed on this resource"


class StaleEpoch(KvspError):
    status = 409
    slug = "kvsp-stale-epoch"
    title = "Epoch lower than one already seen"


class IllegalTransition(KvspError):
    status = 409
    slug = "kvsp-illegal-transition"
    title = "State change not allowed"


class InstanceFailed(IllegalTransition):
    """The PC marked the instance failed (its status expired) and failed its sessions over:
    the live process must take a new epoch, drop those sessions and report again."""

    slug = "kvsp-instance-failed"
    title = "Instance marked failed; report again with a new epoch"


class NotAccepting(IllegalTransition):
    """A draining or sleeping instance refuses new sessions, resumed ones included (KVSP 6.3):
    409, since the request conflicts with the instance's state; the PC places it elsewhere."""

    slug = "kvsp-not-accepting"
    title = "Instance accepts no new sessions"


class RequestTimeout(KvspError):
    status = 408
    slug = "kvsp-request-timeout"
    title = "Request not received in time"


class AlreadyStored(KvspError):
    status = 412
    slug = "kvsp-already-stored"
    title = "A replica for this key is already stored"


class PreconditionRequired(KvspError):
    status = 428
    slug = "kvsp-precondition-required"
    title = "The request must be conditional"


class PayloadTooLarge(KvspError):
    status = 413
    slug = "kvsp-payload-too-large"
    title = "Request body too large"


class UriTooLong(KvspError):
    status = 414
    slug = "kvsp-uri-too-long"
    title = "Request target too long"


class HeaderFieldsTooLarge(KvspError):
    status = 431
    slug = "kvsp-header-fields-too-large"
    title = "Request header fields too large"


class UnsupportedMediaType(KvspError):
    status = 415
    slug = "kvsp-unsupported-media-type"
    title = "Unsupported content type"


class LeaseQuotaExceeded(KvspError):
    status = 429
    slug = "kvsp-lease-quota"
    title = "Lease quota exceeded"


class ServiceUnavailable(KvspError):
    status = 503
    slug = "kvsp-unavailable"
    title = "Service temporarily unavailable"


class NotLeader(ServiceUnavailable):
    """A standby controller: another controller holds the lease, and only it serves; the
    ``leader`` extension member names it when known (decision 0019)."""

    slug = "kvsp-not-leader"
    title = "Not the leading controller"


class NotReady(ServiceUnavailable):
    """``GET readyz`` of a service that serves but should get no traffic yet (or any more):
    its store unreachable, its model not loaded, draining, no active instance."""

    slug = "kvsp-not-ready"
    title = "Not ready for traffic"


class PeerError(ServiceUnavailable):
    """A peer we called failed us. Raised only around a client's own I/O, so a caller's bug
    never passes for an unreachable peer; to the caller's caller it is a 503 like any
    unavailable backing service."""


class PeerUnreachable(PeerError):
    pass


class PeerTimeout(PeerError):
    pass


class PeerProtocolError(PeerError):
    pass


class PeerAnswerTooLarge(PeerProtocolError):
    pass


class CapacityExhausted(KvspError):
    status = 507
    slug = "kvsp-capacity"
    title = "Configured capacity exhausted"


def problem_types() -> dict[str, type[KvspError]]:
    """Every problem slug and the class that raises it (the registry, derived from the tree)."""
    found: dict[str, type[KvspError]] = {}
    pending: list[type[KvspError]] = [KvspError]
    while pending:
        cls = pending.pop()
        found.setdefault(cls.slug, cls)
        pending.extend(cls.__subclasses__())
    return found
