"""Deadlines against a dict model: keys fall due once, in order, at their latest deadline."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.deadlines import Deadlines

operations = st.lists(
    st.tuples(st.sampled_from(["set", "discard", "due"]), st.integers(0, 20), st.integers(0, 100)),
    max_size=300,
)


@given(operations)
def test_deadlines_behave_as_a_dict_of_times(ops: list[tuple[str, int, int]]) -> None:
    deadlines: Deadlines[int] = Deadlines()
    model: dict[int, int] = {}
    for op, key, at in ops:
        if op == "set":
            deadlines.set(key, at)
            model[key] = at
        elif op == "discard":
            deadlines.discard(key)
            model.pop(key, None)
        else:
            expected = sorted((t, k) for k, t in model.items() if t <= at)
            got = deadlines.due(at)
            assert sorted((model[k], k) for k in got) == expected
            assert [model[k] for k in got] == sorted(model[k] for k in got)  # in order
            for k in got:
                del model[k]
        assert len(deadlines) == len(model)
        assert all(deadlines.get(k) == t for k, t in model.items())


def test_moving_deadlines_keeps_the_heap_bounded() -> None:
    deadlines: Deadlines[str] = Deadlines()
    for n in range(10_000):  # one key renewed over and over
        deadlines.set("lease", n)
    assert len(deadlines._heap) <= 64 + 2
    assert deadlines.due(9_998) == []
    assert deadlines.due(9_999) == ["lease"]
    assert "lease" not in deadlines
