"""Session checkpoints and failover (KVSP 6.8)."""

from __future__ import annotations

import pytest

from kvsp.controller.sessions import SessionTable
from kvsp.core.problems import Forbidden, InvalidInput, NotFound, RecordError, StaleEpoch
from tests.controller.factories import SESSION, checkpoint
from tests.index.factories import I1, I2, SCOPE_B


def opened() -> SessionTable:
    table = SessionTable()
    table.open(checkpoint(0), I1)
    return table


def test_6_8_pc_keeps_the_checkpoint_with_the_highest_output_offset() -> None:
    table = opened()
    answer = table.put_checkpoint(checkpoint(16), I1)
    assert (answer.recorded, answer.acknowledged, answer.epoch) == (True, 16, 0)
    late = table.put_checkpoint(checkpoint(8), I1)  # delivered out of order
    assert (late.recorded, late.acknowledged) == (False, 16)
    assert table.get(SESSION).checkpoint.output_offset == 16


def test_a_next_turn_starts_its_output_again_at_offset_0() -> None:
    table = opened()
    table.put_checkpoint(checkpoint(24), I1)
    entry = table.open(checkpoint(0), I2)  # the next turn, on another instance
    assert (entry.instance, entry.checkpoint.output_offset, entry.acknowledged) == (I2, 0, 0)
    answer = table.put_checkpoint(checkpoint(4), I2)
    assert (answer.recorded, answer.acknowledged) == (True, 4)


def test_6_8_non_deterministic_tokens_are_released_only_up_to_the_acknowledged_offset() -> None:
    table = opened()
    assert table.put_checkpoint(checkpoint(4), I1).acknowledged == 4
    assert table.get(SESSION).acknowledged == 4


def test_6_8_pc_must_reject_a_checkpoint_with_a_lower_epoch() -> None:
    table = opened()
    table.put_checkpoint(checkpoint(16), I1)
    resumed = table.move(SESSION, I2)
    assert resumed.epoch == 1
    assert resumed.output_offset == 16
    with pytest.raises(StaleEpoch):
        table.put_checkpoint(checkpoint(32, epoch=0), I1)
    assert table.get(SESSION).checkpoint.output_offset == 16


def test_6_8_any_message_from_the_failed_instance_with_the_old_epoch_is_rejected() -> None:
    table = opened()
    table.move(SESSION, I2)
    with pytest.raises(StaleEpoch):
        table.put_checkpoint(checkpoint(1, epoch=0), I1)
    with pytest.raises(Forbidden):  # the right epoch, but not the serving instance
        table.put_checkpoint(checkpoint(1, epoch=1), I1)
    assert table.put_checkpoint(checkpoint(1, epoch=1), I2).recorded


def test_failover_increments_the_epoch_each_time() -> None:
    table = opened()
    table.move(SESSION, I2)
    table.move(SESSION, I1)
    session = table.get(SESSION)
    assert (session.epoch, session.instance, session.failovers) == (2, I1, 2)
    assert table.served_by(I1) == [session]
    assert table.served_by(I2) == []


def test_bad_checkpoints_change_nothing() -> None:
    table = opened()
    with pytest.raises(NotFound):
        table.put_checkpoint(checkpoint(1, session="00000000-0000-4000-8000-000000000000"), I1)
    with pytest.raises(InvalidInput):
        table.put_checkpoint(checkpoint(1, epoch=3), I1)  # an epoch the PC never issued
    with pytest.raises(RecordError):
        table.put_checkpoint(checkpoint(1, scope_id=SCOPE_B), I1)
    with pytest.raises(Forbidden):
        table.open(checkpoint(0, scope_id=SCOPE_B), I1)
    assert table.get(SESSION).checkpoint.output_offset == 0


def test_sessions_are_bounded() -> None:
    table = SessionTable(max_sessions=2)
    ids = [f"00000000-0000-4000-8000-00000000000{n}" for n in range(3)]
    for s in ids:
        table.open(checkpoint(0, session=s), I1)
    assert len(table) == 2
    with pytest.raises(NotFound):
        table.get(ids[0])
