"""SessionPrefixIndex, pure: which blocks each session owns, as a logical tree over Block Keys.

Block Keys are chained (a key commits to its parent), so the blocks of all sessions form a tree
under ROOT. The index keeps that tree once, however many sessions share a prefix:

- each node has a parent link, its children, and the local tiers holding a copy of the block
  (``g1``, ``g2``; empty when no copy is here);
- each session has a frontier set: the deepest block of each of its branches (several when the
  session forked, e.g. two tool calls from one turn). A session owns its frontiers and their
  ancestors.

It is maintained synchronously: a prefix hit (``hit``: a cache hit creates no stored block, yet
makes the session a member), a block admitted or completed by a request (``admit``), and
residency changes of the pool (``resident``/``gone``). Removing one copy keeps the node while
another remains. When the last local copy goes, frontiers on that node move to the nearest
ancestor that still has a copy, or the branch is removed; a node without a copy stays only while
it connects descendants that have one (or is a session's frontier), so the tree never holds
more than the blocks present plus the paths to them.

``blocks(session)`` resolves a session to its blocks, root first, for KvHints.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["SessionPrefixIndex"]

LocalTier = str  # "g1" | "g2"
#: a block's key: a Block Key, or whatever names a block uniquely where the index is used
K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class _Node(Generic[K]):
    parent: K | None
    children: set[K] = field(default_factory=set)
    tiers: set[LocalTier] = field(default_factory=set)
    #: sessions whose frontier is this node
    frontier_of: set[str] = field(default_factory=set)


class SessionPrefixIndex(Generic[K]):
    def __init__(self) -> None:
        self._nodes: dict[K, _Node[K]] = {}
        #: per session, its frontiers in the order they became frontiers
        self._frontiers: dict[str, dict[K, None]] = {}

    # -- queries -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def parent(self, key: K) -> K | None:
        return self._nodes[key].parent

    def tiers(self, key: K) -> frozenset[LocalTier]:
        node = self._nodes.get(key)
        return frozenset() if node is None else frozenset(node.tiers)

    def frontiers(self, session: str) -> frozenset[K]:
        return frozenset(self._frontiers.get(session, ()))

    def sessions(self) -> frozenset[str]:
        return frozenset(self._frontiers)

    def path(self, key: K) -> list[K]:
        """``key`` and its ancestors, root first."""
        out = []
        cursor: K | None = key
        while cursor is not None:
            out.append(cursor)
            cursor = self._nodes[cursor].parent
        out.reverse()
        return out

    def blocks(self, session: str) -> list[K]:
        """Every block the session owns (its branches, shared ancestors once), root first."""
        seen: dict[K, None] = {}
        for frontier in self._frontiers.get(session, ()):
            for key in self.path(frontier):
                seen.setdefault(key, None)
        return list(seen)

    def members(self, key: K) -> frozenset[str]:
        """Sessions owning ``key``: those with a frontier at it or below it."""
        found: set[str] = set()
        stack = [key]
        while stack:
            node = self._nodes.get(stack.pop())
            if node is not None:
                found.update(node.frontier_of)
                stack.extend(node.children)
        return frozenset(found)

    # -- maintenance ---------------------------------------------------------------------------

    def hit(
        self,
        session: str,
        keys: Sequence[K],
        tiers: Sequence[Iterable[LocalTier]],
        parent: K | None = None,
    ) -> None:
        """A request of ``session`` reused these chained blocks (``parent`` before the first),
        held in ``tiers`` (one set per key): the session owns them from now on."""
        self._extend(session, keys, parent, tiers)

    def admit(
        self, session: str, keys: Sequence[K], parent: K | None = None, tier: LocalTier = "g1"
    ) -> None:
        """A request of ``session`` completed these chained blocks, now held in ``tier``."""
        self._extend(session, keys, parent, [(tier,)] * len(keys))

    def _extend(
        self,
        session: str,
        keys: Sequence[K],
        parent: K | None,
        tiers: Sequence[Iterable[LocalTier]],
    ) -> None:
        if not keys:
            return
        if len(tiers) != len(keys):
            raise ValueError("one tier set per key")
        if parent is not None and parent not in self._nodes:
            raise KeyError(f"parent {parent!r} is not indexed")
        for key, held in zip(keys, tiers, strict=True):
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = _Node(parent)
                if parent is not None:
                    self._nodes[parent].children.add(key)
            elif node.parent != parent:
                raise ValueError(f"block {key!r} is indexed under another parent")
            node.tiers.update(held)
            parent = key
        last = keys[-1]
        # a frontier that is an ancestor of the new end is the same branch, extended; frontiers
        # are never ancestors of one another, so there is at most one
        frontiers = self._frontiers.get(session)
        if frontiers:
            cursor = self._nodes[last].parent
            while cursor is not None and cursor not in frontiers:
                cursor = self._nodes[cursor].parent
            if cursor is not None:
                self._drop_frontier(session, cursor)
        self._add_frontier(session, last)

    def _add_frontier(self, session: str, key: K) -> None:
        """``key`` becomes a frontier of ``session`` unless a frontier already lies below it."""
        frontiers = self._frontiers.get(session, {})
        if self._nodes[key].children and any(f != key and self._below(f, key) for f in frontiers):
            return
        self._frontiers.setdefault(session, {})[key] = None
        self._nodes[key].frontier_of.add(session)

    def _below(self, key: K, ancestor: K) -> bool:
        """Whether ``ancestor`` is on ``key``'s path to the root."""
        cursor: K | None = key
        while cursor is not None:
            if cursor == ancestor:
                return True
            cursor = self._nodes[cursor].parent
        return False

    def resident(self, key: K, tiers: Iterable[LocalTier]) -> None:
        """The pool now holds ``key`` in exactly ``tiers`` (no-op for blocks not indexed:
        a block joins the tree through a session)."""
        node = self._nodes.get(key)
        if node is None:
            return
        node.tiers = set(tiers)
        if not node.tiers:
            self._lost(key)

    def gone(self, key: K) -> None:
        """The last local copy of ``key`` is gone."""
        self.resident(key, ())

    def end(self, session: str) -> None:
        """Forget a session's membership (the blocks stay while they are held)."""
        for frontier in list(self._frontiers.get(session, ())):
            self._drop_frontier(session, frontier)
            self._prune(frontier)
        self._frontiers.pop(session, None)

    def _lost(self, key: K) -> None:
        node = self._nodes[key]
        for session in list(node.frontier_of):
            self._drop_frontier(session, key)
            ancestor = node.parent
            while ancestor is not None and not self._nodes[ancestor].tiers:
                ancestor = self._nodes[ancestor].parent
            if ancestor is not None:
                self._add_frontier(session, ancestor)
        self._prune(key)

    def _drop_frontier(self, session: str, key: K) -> None:
        frontiers = self._frontiers.get(session)
        if frontiers is not None:
            frontiers.pop(key, None)
            if not frontiers:
                del self._frontiers[session]
        node = self._nodes.get(key)
        if node is not None:
            node.frontier_of.discard(session)

    def _prune(self, key: K) -> None:
        """Remove ``key`` and then its ancestors while they have no copy, no children and are
        no session's frontier."""
        cursor: K | None = key
        while cursor is not None:
            node = self._nodes.get(cursor)
            if node is None or node.tiers or node.children or node.frontier_of:
                return
            del self._nodes[cursor]
            if node.parent is not None:
                self._nodes[node.parent].children.discard(cursor)
            cursor = node.parent

    # -- checking ------------------------------------------------------------------------------

    def check(self) -> Iterator[str]:
        """Every broken invariant, as text (none in a healthy index; used by tests)."""
        for key, node in self._nodes.items():
            if node.parent is not None and key not in self._nodes[node.parent].children:
                yield f"{key} is missing from its parent's children"
            for child in node.children:
                if self._nodes[child].parent != key:
                    yield f"{child} does not point back to {key}"
            if not node.tiers and not node.children and not node.frontier_of:
                yield f"{key} has no copy, no children and no session"
            for session in node.frontier_of:
                if key not in self._frontiers.get(session, ()):
                    yield f"{key} thinks it is a frontier of {session}"
        for session, frontiers in self._frontiers.items():
            if not frontiers:
                yield f"{session} has an empty frontier set"
            for key in frontiers:
                if session not in self._nodes[key].frontier_of:
                    yield f"{session}'s frontier {key} does not know it"
                if any(o != key and self._below(o, key) for o in frontiers):
                    yield f"{session}'s frontier {key} is an ancestor of another frontier"
