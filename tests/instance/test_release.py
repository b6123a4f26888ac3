"""The release gate (KVSP 6.8) on its own: every rule the SIGKILL tests rely on, in process."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvsp.instance.release import ReleaseGate


def test_a_gated_session_releases_only_what_an_acknowledged_checkpoint_covers() -> None:
    gate = ReleaseGate(gated=True, checkpoints=True, release_batch=3)
    assert [gate.on_token() for _ in range(4)] == [False, False, True, True]
    assert gate.released == 0
    gate.on_ack(2)
    assert (gate.released, gate.acknowledged) == (2, 2)
    assert gate.on_token()  # 3 unacknowledged again: 5 - 2
    gate.on_ack(99)  # a controller that acknowledges more than was sent
    assert gate.released == 5
    gate.on_ack(1)  # an older answer arriving late
    assert (gate.released, gate.acknowledged) == (5, 99)


def test_an_ungated_session_releases_at_once_and_checkpoints_on_a_period() -> None:
    gate = ReleaseGate(gated=False, checkpoints=True, checkpoint_every=2)
    assert [gate.on_token() for _ in range(4)] == [False, True, False, True]
    assert gate.released == 4
    assert gate.on_block()
    alone = ReleaseGate(gated=False, checkpoints=False, checkpoint_every=1)
    assert not alone.on_token()
    assert not alone.on_block()
    assert alone.released == 1


def test_a_resumed_session_goes_on_from_its_offset() -> None:
    gate = ReleaseGate.resumed(True, True, 7, release_batch=2)
    assert (gate.generated, gate.released, gate.acknowledged) == (7, 7, 7)
    assert not gate.on_token()
    assert gate.on_token()
    assert gate.released == 7


class GateMachine(RuleBasedStateMachine):
    """Tokens, blocks and acknowledgements in any order, answers late or repeated: a reader
    never gets a token past what was generated, nor, gated, past what was acknowledged."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = ReleaseGate(gated=True, checkpoints=True, release_batch=3)
        self.sent: list[int] = []  # the offsets of the checkpoints sent
        self.released = 0

    @rule()
    def token(self) -> None:
        if self.gate.on_token():
            self.sent.append(self.gate.generated)

    @rule()
    def block(self) -> None:
        if self.gate.on_block():
            self.sent.append(self.gate.generated)

    @precondition(lambda self: self.sent)
    @rule(which=st.integers(0, 1000))
    def answer(self, which: int) -> None:
        self.gate.on_ack(self.sent[which % len(self.sent)])

    @invariant()
    def released_only_what_is_covered(self) -> None:
        gate = self.gate
        assert gate.released <= gate.generated
        assert gate.released <= gate.acknowledged
        assert gate.released >= self.released  # never taken back
        self.released = gate.released
        unacknowledged = gate.generated - gate.acknowledged
        if unacknowledged >= gate.release_batch:  # a checkpoint covering them was sent
            assert self.sent
            assert self.sent[-1] >= gate.acknowledged + gate.release_batch


TestGate = GateMachine.TestCase
