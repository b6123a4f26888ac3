"""Session checkpoints and failover (KVSP 6.8)."""

from __future__ import annotations

import pytest

from kvsp.controller.sessions import SessionTable, resumers, sampler_for
from kvsp.core.problems import Forbidden, InvalidInput, NotFound, RecordError, StaleEpoch
from kvsp.core.records import Sampler
from tests.controller.factories import SESSION, checkpoint
from tests.index.factories import I1, I2, SCOPE_B, status


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


def test_an_orphaned_open_turn_is_pending_until_its_failover_settles() -> None:
    table = opened()
    table.open(checkpoint(0, session="00000000-0000-4000-8000-000000000001"), I1).turn_done = True
    (orphan,) = table.orphan(I1)  # a delivered turn has nothing left to resume
    assert (orphan.session, orphan.pending) == (SESSION, True)
    assert table.pending() == [orphan]
    table.move(SESSION, I2)
    assert table.pending() == [orphan]  # moved, not yet resumed
    assert table.settle(SESSION) is orphan
    assert table.pending() == []
    assert table.settle("gone") is None
    table.orphan(I2)
    table.open(checkpoint(0), I1)  # the next turn is placed afresh
    assert table.pending() == []


def test_a_resume_point_changes_nothing_until_the_move_and_the_store_may_know_more() -> None:
    table = opened()
    table.put_checkpoint(checkpoint(4), I1)
    durable = checkpoint(8)  # the store took a later checkpoint this table did not see
    point = table.resume_point(SESSION, 2, durable)
    assert (point.epoch, point.output_offset) == (2, 8)
    assert (table.get(SESSION).epoch, table.get(SESSION).instance) == (0, I1)
    assert table.resume_point(SESSION, 1, checkpoint(2)).output_offset == 4
    with pytest.raises(InvalidInput):
        table.resume_point(SESSION, 0)
    table.move(SESSION, I2, point)  # epoch 1 was refused by the instance tried first
    session = table.get(SESSION)
    assert (session.epoch, session.instance, session.failovers) == (2, I2, 2)
    assert session.checkpoint.output_offset == 8


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


GREEDY = Sampler(method="greedy", deterministic=True)
ENGINE_A = "kvsp 0.1.0; transformers 4.57.1; torch 2.13.0; cpu float32; threads 2"
ENGINE_B = "kvsp 0.1.0; vllm 0.32.0; torch 2.13.0; cpu float32 eager; pages 16"


def test_4_4_deterministic_only_where_every_instance_that_may_resume_computes_the_same_bits() -> (
    None
):
    a1, a2 = status(I1, engine=ENGINE_A), status(I2, engine=ENGINE_A)
    b = status("http://127.0.0.1:9203/kvsp/", engine=ENGINE_B)
    unknown = status("http://127.0.0.1:9204/kvsp/")
    assert sampler_for(GREEDY, a1, [a1, a2]).deterministic
    # a vLLM-backed instance could resume it: its tokens must wait for acknowledged checkpoints
    assert not sampler_for(GREEDY, a1, [a1, a2, b]).deterministic
    assert not sampler_for(GREEDY, a1, [a1, unknown]).deterministic  # no identity: different
    assert not sampler_for(GREEDY, unknown, [unknown]).deterministic
    assert not sampler_for(GREEDY, None, [a1]).deterministic  # launched, not reported yet
    top_p = checkpoint().sampler
    assert sampler_for(top_p, a1, [a1]) == top_p  # never made deterministic
    assert sampler_for(GREEDY, a1, [a1]).method == "greedy"


def test_a_deterministic_session_resumes_only_on_an_identical_engine() -> None:
    table = SessionTable()
    entry = table.open(checkpoint(0, sampler=GREEDY.to_json()), I1, engine=ENGINE_A)
    same, other = (
        status(I2, engine=ENGINE_A),
        status("http://127.0.0.1:9203/kvsp/", engine=ENGINE_B),
    )
    unknown = status("http://127.0.0.1:9204/kvsp/")
    assert resumers(entry, [other, same, unknown]) == [same]
    assert resumers(entry, [other, unknown]) == []  # nowhere: another engine may alter output
    gated = table.open(checkpoint(0), I1, engine=ENGINE_A)  # top-p: tokens wait for acks
    assert resumers(gated, [other, same, unknown]) == [other, same, unknown]
