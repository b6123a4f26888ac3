"""Instance statuses and lifecycle (KVSP 6.3), with a manual clock."""

from __future__ import annotations

import pytest

from kvsp.controller.instances import TRANSITIONS, InstancePolicy, InstanceTable
from kvsp.core.clock import ManualClock
from kvsp.core.problems import (
    IllegalTransition,
    InstanceFailed,
    NotFound,
    RecordError,
    StaleEpoch,
)
from kvsp.core.records import InstanceState
from tests.index.factories import I1, I2, status

A, D, S, F = (
    InstanceState.ACTIVE,
    InstanceState.DRAINING,
    InstanceState.SLEEPING,
    InstanceState.FAILED,
)


def table(min_active: int = 1) -> tuple[InstanceTable, ManualClock]:
    clock = ManualClock()
    return InstanceTable(clock, InstancePolicy(min_active=min_active)), clock


def test_6_3_pc_must_discard_records_with_a_lower_epoch() -> None:
    t, _ = table()
    t.put_status(status(I1, epoch=5, queued=1))
    with pytest.raises(StaleEpoch):
        t.put_status(status(I1, epoch=4, queued=9))
    assert t.get(I1).status.queued == 1
    assert t.get(I1).epoch == 5


def test_6_3_an_expired_record_makes_the_instance_failed() -> None:
    t, clock = table()
    t.put_status(status(I1, ttl_ms=3_000))
    clock.advance(2_999)
    assert t.expire() == []
    clock.advance(1)
    (failed,) = t.expire()
    assert failed.url == I1
    assert failed.state is F
    assert t.active() == []


def test_6_3_a_failed_instance_comes_back_only_with_a_higher_epoch() -> None:
    t, clock = table()
    t.put_status(status(I1, epoch=1, ttl_ms=1_000))
    clock.advance(1_000)
    t.expire()
    with pytest.raises(IllegalTransition):
        t.put_status(status(I1, epoch=1))
    assert t.put_status(status(I1, epoch=2)) is A


def test_6_3_sleep_request_is_granted_by_policy_with_min_active() -> None:
    t, _ = table(min_active=1)
    t.put_status(status(I1))
    assert t.put_status(status(I1, requested_state="sleeping")) is A  # the last active one
    t.put_status(status(I2))
    assert t.put_status(status(I1, requested_state="sleeping")) is D
    assert t.put_status(status(I2, requested_state="sleeping")) is A
    assert [i.url for i in t.active()] == [I2]


def test_6_3_draining_instance_sleeps_when_it_has_no_sessions_left() -> None:
    t, _ = table(min_active=0)
    t.put_status(status(I1))
    assert t.put_status(status(I1, requested_state="sleeping")) is D
    assert t.put_status(status(I1, state="draining", running=2)) is D
    with pytest.raises(IllegalTransition):
        t.put_status(status(I1, state="sleeping", running=1))
    assert t.put_status(status(I1, state="sleeping", running=0)) is S


def test_6_3_a_sleeping_instance_becomes_active_only_on_a_change_from_the_pc() -> None:
    t, _ = table(min_active=0)
    t.put_status(status(I1, state="sleeping"))
    with pytest.raises(IllegalTransition):
        t.put_status(status(I1, state="active"))
    assert t.get(I1).state is S
    t.set_state(I1, A)
    assert t.put_status(status(I1, state="active")) is A


def test_6_3_instances_cannot_drain_or_fail_themselves() -> None:
    t, _ = table()
    t.put_status(status(I1))
    for state in ("draining", "sleeping", "failed"):
        with pytest.raises(IllegalTransition):
            t.put_status(status(I1, state=state))
    assert t.get(I1).state is A
    with pytest.raises(IllegalTransition):
        t.put_status(status(I2, state="draining"))  # a new instance starts active or asleep
    with pytest.raises(NotFound):
        t.get(I2)


def test_transition_table_is_the_only_way() -> None:
    t, _ = table()
    t.put_status(status(I1))
    with pytest.raises(IllegalTransition):
        t.set_state(I1, S)  # the PC wakes or drains; sleeping is the instance's to report
    t.set_state(I1, D)
    assert t.get(I1).state is D
    t.set_state(I1, A)
    assert (D, A) in TRANSITIONS
    assert (S, D) not in TRANSITIONS
    assert all(to is not F or frm is not F for frm, to in TRANSITIONS)


def test_failures_noticed_by_other_calls_are_still_handed_out() -> None:
    t, clock = table()
    t.put_status(status(I1, ttl_ms=1_000))
    clock.advance(1_000)
    t.put_status(status(I2))  # notices that I1 failed
    assert [i.url for i in t.expire()] == [I1]
    assert t.expire() == []


def test_a_live_instance_marked_failed_is_told_to_take_a_new_epoch() -> None:
    """Liveness heals: the same epoch after expiry is ``InstanceFailed`` (409), and the
    instance's next epoch is active at once."""
    t, clock = table()
    t.put_status(status(I1, epoch=1, ttl_ms=1_000))
    clock.advance(1_000)
    t.expire()
    with pytest.raises(InstanceFailed) as raised:
        t.put_status(status(I1, epoch=1))
    assert raised.value.status == 409
    assert t.get(I1).state is F
    assert t.put_status(status(I1, epoch=clock.wall_ms())) is A


def test_a_restart_before_expiry_hands_the_old_epoch_to_failover() -> None:
    t, _ = table()
    t.put_status(status(I1, epoch=1))
    assert t.expire() == []
    assert t.put_status(status(I1, epoch=2)) is A
    (failed,) = t.expire()
    assert failed.url == I1
    assert t.expire() == []
    assert t.get(I1).state is A


def test_an_epoch_far_ahead_of_the_clock_is_refused_and_changes_nothing() -> None:
    t, clock = table()
    t.put_status(status(I1, epoch=5))
    with pytest.raises(RecordError):
        t.put_status(status(I1, epoch=clock.wall_ms() + 86_400_001))
    assert t.get(I1).epoch == 5
    t.put_status(status(I1, epoch=clock.wall_ms() + 86_400_000))  # within the allowed skew


def test_a_checked_wake_changes_nothing_until_it_is_made() -> None:
    t, _ = table(min_active=0)
    t.put_status(status(I1))
    t.put_status(status(I1, requested_state="sleeping"))
    t.put_status(status(I1, state="sleeping", running=0))
    assert t.get(I1).state is S
    t.check_set_state(I1, A)
    assert t.get(I1).state is S
    with pytest.raises(IllegalTransition):
        t.check_set_state(I1, F)
    t.set_state(I1, A)
    assert t.get(I1).state is A
