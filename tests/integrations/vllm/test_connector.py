"""Which replicas the connector loads from: never one served only through MOQT."""

from __future__ import annotations

from kvsp.core.records import ReplicaRecord
from kvsp.holder.client import MOQT_SKIPS
from kvsp.integrations.vllm.connector import _holders_first
from tests.index.factories import H1, H2, NAMESPACE_A, RELAY, replica


def test_moqt_replicas_are_passed_over_and_the_nearby_holder_comes_first() -> None:
    moqt = ReplicaRecord.parse(
        {**replica(0).to_json(), "holder": RELAY, "moqt_namespace": NAMESPACE_A}
    )
    far, near = replica(0, H1), replica(0, H2)
    before = MOQT_SKIPS.total
    assert _holders_first([moqt, far, near], H2) == (near, far)
    assert _holders_first([moqt], H2) == ()  # the connector's lookup ends its prefix there
    assert MOQT_SKIPS.total == before + 2
