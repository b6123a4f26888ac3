"""SessionPrefixIndex: the RFC's example tree, copies leaving G1 and G2, and random sequences of
admissions, hits and evictions that never break the invariants."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsp.instance.session_index import SessionPrefixIndex


def rfc_tree() -> SessionPrefixIndex:
    """ROOT -> hA -> {hAB -> hABC, hAD, hAE}; ROOT -> hX -> hXY -> hXYZ, with session_1 at hABC,
    session_2 at hAD, session_3 at hAE, session_4 at hXYZ and session_5 on two branches."""
    index = SessionPrefixIndex()
    index.admit("session_1", ["hA", "hAB", "hABC"])
    index.hit("session_2", ["hA"], [{"g1"}])
    index.admit("session_2", ["hAD"], parent="hA")
    index.hit("session_3", ["hA"], [{"g1"}])
    index.admit("session_3", ["hAE"], parent="hA")
    index.admit("session_4", ["hX", "hXY", "hXYZ"])
    index.hit("session_5", ["hA", "hAB", "hABC"], [{"g1"}] * 3)
    index.hit("session_5", ["hAD"], [{"g1"}], parent="hA")
    return index


def test_the_rfc_example_tree() -> None:
    index = rfc_tree()
    assert list(index.check()) == []
    assert len(index) == 8  # shared ancestors stored once
    assert [index.parent(k) for k in ("hABC", "hAB", "hAD", "hAE", "hA", "hXYZ", "hX")] == [
        "hAB", "hA", "hA", "hA", None, "hXY", None,
    ]  # fmt: skip
    assert index.frontiers("session_1") == {"hABC"}
    assert index.frontiers("session_2") == {"hAD"}
    assert index.frontiers("session_5") == {"hABC", "hAD"}  # concurrent branches
    assert index.blocks("session_5") == ["hA", "hAB", "hABC", "hAD"]
    assert index.blocks("session_4") == ["hX", "hXY", "hXYZ"]
    assert index.members("hA") == {"session_1", "session_2", "session_3", "session_5"}
    assert index.members("hAB") == {"session_1", "session_5"}


def test_a_session_extending_its_branch_moves_its_frontier() -> None:
    index = rfc_tree()
    index.admit("session_2", ["hADF"], parent="hAD")
    assert index.frontiers("session_2") == {"hADF"}
    index.hit("session_1", ["hA", "hAB"], [{"g1"}] * 2)  # a shorter hit stays inside the branch
    assert index.frontiers("session_1") == {"hABC"}
    assert list(index.check()) == []


def test_copies_leaving_g1_and_g2() -> None:
    index = rfc_tree()
    index.resident("hABC", {"g2"})  # G1 copy gone, G2 copy remains: nothing changes
    assert index.frontiers("session_1") == {"hABC"}
    assert index.tiers("hABC") == {"g2"}
    index.gone("hABC")  # last copy: frontiers move to the nearest resident ancestor
    assert "hABC" not in index
    assert index.frontiers("session_1") == {"hAB"}
    assert index.frontiers("session_5") == {"hAB", "hAD"}
    index.gone("hAB")
    assert index.frontiers("session_1") == {"hA"}
    assert index.frontiers("session_5") == {"hAD"}  # hA is already on its other branch
    index.gone("hA")  # no copy, but it connects hAD and hAE: it stays, parent-only
    assert "hA" in index
    assert index.tiers("hA") == frozenset()
    assert "session_1" not in index.sessions()  # no resident ancestor left: branch removed
    index.gone("hAD")
    assert index.frontiers("session_5") == frozenset()
    assert "session_2" not in index.sessions()
    index.gone("hAE")  # the last child of hA: hA goes too
    assert "hA" not in index
    assert index.blocks("session_4") == ["hX", "hXY", "hXYZ"]
    assert list(index.check()) == []


def test_ending_a_session_keeps_held_blocks() -> None:
    index = rfc_tree()
    index.end("session_4")
    assert "session_4" not in index.sessions()
    assert "hXYZ" in index  # still held here
    index.gone("hXYZ")
    index.gone("hXY")
    index.gone("hX")
    assert "hX" not in index
    assert list(index.check()) == []


#: chains over a small alphabet, so that branches share prefixes often
KEYS = st.lists(st.sampled_from("abc"), min_size=1, max_size=4).map(
    lambda letters: ["".join(letters[: i + 1]) for i in range(len(letters))]
)
SESSIONS = st.sampled_from(["s1", "s2", "s3"])
OPS = st.one_of(
    st.tuples(st.just("admit"), SESSIONS, KEYS),
    st.tuples(st.just("hit"), SESSIONS, KEYS),
    st.tuples(st.just("g1-evict"), SESSIONS, KEYS),
    st.tuples(st.just("g2-evict"), SESSIONS, KEYS),
    st.tuples(st.just("end"), SESSIONS, KEYS),
)


@given(st.lists(OPS, max_size=60))
def test_random_sequences_keep_the_invariants(ops: list[tuple[str, str, list[str]]]) -> None:
    index = SessionPrefixIndex()
    held: dict[str, set[str]] = {}  # the pool: key -> tiers holding it
    for op, session, chain in ops:
        key = chain[-1]
        if op == "admit":
            # a request computes the whole chain; blocks already held stay where they are
            for k in chain:
                held.setdefault(k, set()).add("g1")
            index.admit(session, chain)
        elif op == "hit":
            prefix = []
            for k in chain:
                if not held.get(k):
                    break
                prefix.append(k)
            index.hit(session, prefix, [held[k] for k in prefix])
        elif op == "end":
            index.end(session)
        elif held.get(key):
            held[key].discard("g1" if op == "g1-evict" else "g2")
            if op == "g1-evict":
                held[key].add("g2")  # demoted, not dropped
            index.resident(key, held[key])
        assert list(index.check()) == []
        for s in index.sessions():
            for frontier in index.frontiers(s):
                assert held.get(frontier), "a frontier always has a local copy"
        for k in list(held):
            if held[k] and any(k in index.blocks(s) for s in index.sessions()):
                assert k in index
