"""The KV event feed as a state machine: whatever order tokens and residency arrive in, a
subscriber that applies the events holds exactly the (block, medium) pairs the instance holds
with known tokens, each stored once, with its tokens and parent; a snapshot restates the same."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.kvevents.feed import BlockId, KvEventFeed
from kvsp.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, external_hash

B = 4
#: a chain of 6 blocks in one scope
CHAIN: list[BlockId] = [("c" * 64, "s" * 16, f"{i:064x}") for i in range(1, 7)]
TOKENS = {block: tuple(range(10 * i, 10 * i + B)) for i, block in enumerate(CHAIN)}
MEDIA = ["GPU", "CPU", "STORAGE"]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("learn"), st.integers(0, 5)),
        st.tuples(
            st.just("resident"),
            st.integers(0, 5),
            st.frozensets(st.sampled_from(MEDIA)),
        ),
    ),
    max_size=40,
)


class Subscriber:
    """What a consumer of the events holds: (hash, medium) -> (tokens, parent)."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], tuple[tuple[int, ...], int | None]] = {}

    def apply(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, BlockStored):
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert (h, event.medium) not in self.held, "stored twice"
                    toks = tuple(event.token_ids[i * B : (i + 1) * B])
                    self.held[(h, event.medium)] = (toks, parent)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    del self.held[(h, event.medium)]


@given(ops)
def test_a_subscriber_holds_what_the_instance_holds_with_known_tokens(
    steps: list[tuple[Any, ...]],
) -> None:
    feed = KvEventFeed(B, max_learned=3)
    subscriber = Subscriber()
    subscriber.apply(feed.snapshot())
    media: dict[BlockId, frozenset[str]] = {}
    known: set[BlockId] = set()
    learned_order: list[BlockId] = []
    for step in steps:
        block = CHAIN[step[1]]
        if step[0] == "learn":
            parent = CHAIN[step[1] - 1] if step[1] else None
            feed.learn(block, parent, TOKENS[block])
            if media.get(block):
                known.add(block)
            else:
                learned_order = [b for b in learned_order if b != block] + [block]
                learned_order = learned_order[-3:]  # max_learned: oldest forgotten
        else:
            was = media.get(block, frozenset())
            now = step[2]
            feed.resident(block, now)
            if not was and now and block in learned_order:
                known.add(block)
                learned_order.remove(block)
            if not now:
                known.discard(block)
            media[block] = now
        subscriber.apply(feed.take())
        expected = {
            (external_hash(bytes.fromhex(b[2])), m)
            for b in known for m in media.get(b, ())
        }  # fmt: skip
        assert set(subscriber.held) == expected
        for (h, _), (toks, parent) in subscriber.held.items():
            index = next(i for i, b in enumerate(CHAIN) if external_hash(bytes.fromhex(b[2])) == h)
            assert toks == TOKENS[CHAIN[index]]
            assert parent == (
                None if index == 0 else external_hash(bytes.fromhex(CHAIN[index - 1][2]))
            )
        if step[0] == "learn" and not steps.index(step) % 3:
            restated = Subscriber()
            restated.apply(feed.snapshot())
            assert restated.held == subscriber.held
            subscriber = restated


def test_consecutive_blocks_of_a_chain_go_in_one_store() -> None:
    feed = KvEventFeed(B)
    for i, block in enumerate(CHAIN[:3]):
        feed.learn(block, CHAIN[i - 1] if i else None, TOKENS[block], "s1")
    for block in CHAIN[:3]:
        feed.resident(block, frozenset({"GPU"}))
    (event,) = feed.take()  # one store for the chain, one extra-keys entry per block
    assert isinstance(event, BlockStored)
    assert event.extra_keys == [("s" * 16,), None, None]  # the scope salts the first block
    assert len(event.block_hashes) == 3
    assert event.token_ids == [t for block in CHAIN[:3] for t in TOKENS[block]]
    assert event.session_id == "s1"


def test_a_block_of_the_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="4 tokens"):
        KvEventFeed(B).learn(CHAIN[0], None, (1, 2, 3))
