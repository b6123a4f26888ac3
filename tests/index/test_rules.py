"""Who may publish, withdraw, look up and report at the IS, and a record matching its path."""

from __future__ import annotations

import pytest

from kvsp.auth import Principal, Role
from kvsp.core.problems import Forbidden, RecordError
from kvsp.index.rules import (
    authorize_lookup,
    authorize_replicas,
    authorize_status,
    check_path,
)
from tests.index.factories import (
    COMPAT,
    H1,
    H2,
    I1,
    SCOPE_A,
    SCOPE_B,
    key,
    ref,
    replica,
    status,
)


def test_path_must_match_body() -> None:
    record = replica(0)
    check_path(record, COMPAT, SCOPE_A, key(0))
    with pytest.raises(RecordError, match="match the path"):
        check_path(record, COMPAT, SCOPE_A, key(1))


def _principal(roles: set[Role], scopes: set[str], holders: set[str]) -> Principal:
    return Principal("p", frozenset(roles), frozenset(scopes), frozenset(holders))


def test_every_replica_of_a_batch_is_authorized_and_the_first_refused_is_named() -> None:
    principal = _principal({Role.HOLDER}, {SCOPE_A}, {H1})
    authorize_replicas(principal, [replica(n) for n in range(64)])
    batch = [replica(0), replica(1, holder=H2), replica(2, scope=SCOPE_B), replica(3)]
    with pytest.raises(Forbidden, match="may not act for holder"):
        authorize_replicas(principal, batch)
    with pytest.raises(Forbidden, match=f"not authorized for scope {SCOPE_B}"):
        authorize_replicas(principal, [*[replica(n) for n in range(8)], ref(9, scope=SCOPE_B)])


@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("scope_ok", [True, False])
@pytest.mark.parametrize("holder_ok", [True, False])
def test_authorization_matrix(role: Role, scope_ok: bool, holder_ok: bool) -> None:
    principal = _principal({role}, {SCOPE_A if scope_ok else SCOPE_B}, {H1 if holder_ok else H2})
    may_publish = (
        role in (Role.HOLDER, Role.INSTANCE, Role.INGEST, Role.ADMIN) and scope_ok and holder_ok
    )
    for subjects in ([replica(0)], [ref(0)]):
        if may_publish:
            authorize_replicas(principal, subjects)
        else:
            with pytest.raises(Forbidden):
                authorize_replicas(principal, subjects)
    # a scraper reads metrics, a front end places with the controller, a router asks the
    # controller, an ingest only publishes: none of them looks up
    if scope_ok and role not in (Role.METRICS, Role.FRONTEND, Role.ROUTER, Role.INGEST):
        authorize_lookup(principal, SCOPE_A)
    else:
        with pytest.raises(Forbidden):
            authorize_lookup(principal, SCOPE_A)
    instance = _principal({role}, {SCOPE_A}, {I1 if holder_ok else H2})
    if role in (Role.INSTANCE, Role.CONTROLLER, Role.ADMIN) and holder_ok:
        authorize_status(instance, status(I1))
    else:
        with pytest.raises(Forbidden):
            authorize_status(instance, status(I1))
