"""One session's request on an instance: its keys, its tokens, where its reuse came from, and
the gate that decides which tokens a reader may have (``instance/release.py``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvsp.auth import Principal
from kvsp.core.hints import HintOutcome, KvHints
from kvsp.core.records import Sampler, SessionCheckpoint
from kvsp.core.shared import ScopedChain
from kvsp.holder.blocks import BlockId
from kvsp.instance.release import ReleaseGate
from kvsp.tenants import Tenant

__all__ = ["MOVED", "Session", "TokenEvent"]

#: why a session of an epoch the controller marked failed stopped (it was resumed elsewhere)
MOVED = "moved: the controller resumed this session elsewhere"


@dataclass(frozen=True)
class TokenEvent:
    index: int
    epoch: int
    token: int


@dataclass
class Session:
    session: str
    tenant: Tenant
    epoch: int
    sampler: Sampler
    max_tokens: int
    prompt_blocks: tuple[str, ...]
    prompt_tail: tuple[int, ...]
    #: the tokens of the last prompt block when the prompt ends on a block boundary (a
    #: checkpoint's extension member ``last_block``: what resuming it there recomputes)
    last_block: tuple[int, ...] | None
    #: keys of the blocks after the prompt blocks (tail + output), extended as tokens come; it
    #: knows each block's scope (a shared prefix's first blocks are in a shared scope)
    chain: ScopedChain
    gate: ReleaseGate
    generated: list[int] = field(default_factory=list)
    #: the tokens of the prompt blocks, where this instance was given them (a resumed
    #: session's are not): what the KV events of those blocks carry
    prompt_tokens: tuple[int, ...] = ()
    #: prompt tokens whose KV was reused, by where it came from (g1, g2, remote)
    cached: dict[str, int] = field(default_factory=dict)
    #: blocks this session uses (referenced until it ends), and its pending block stores
    uses: list[BlockId] = field(default_factory=list)
    stores: set[asyncio.Task[None]] = field(default_factory=set)
    #: hints to execute once the request is done (sent by this controller), and their outcomes
    hints: tuple[Principal, KvHints] | None = None
    hint_outcomes: list[HintOutcome] = field(default_factory=list)
    #: whether the engine has taken a step of it (before that it is queued: loading its
    #: cache or waiting behind other sessions' steps)
    begun: bool = False
    done: bool = False
    error: str | None = None
    #: why generation was stopped early (read by the engine thread between steps)
    cancelled: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: one checkpoint sender at a time (it sends the latest checkpoint when it goes)
    checkpointing: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def released(self) -> int:
        """Output tokens a reader may have (KVSP 6.8)."""
        return self.gate.released

    def cancel(self, reason: str) -> None:
        """Stop generating at the next step (the engine thread checks between steps)."""
        if self.cancelled is None:
            self.cancelled = reason

    def add_token(self, token: int) -> bool:
        """The next output token; whether a checkpoint should go now."""
        self.generated.append(token)
        self.chain.extend([token])
        return self.gate.on_token()

    def keys(self) -> list[str]:
        """The Block Keys of every complete block, in order."""
        return [*self.prompt_blocks, *(k.hex() for k in self.chain.keys)]

    def key_of(self, index: int) -> str | None:
        if index < len(self.prompt_blocks):
            return self.prompt_blocks[index]
        keys = self.chain.keys
        offset = index - len(self.prompt_blocks)
        return keys[offset].hex() if offset < len(keys) else None

    def tokens_of(self, index: int, block_tokens: int) -> tuple[int, ...] | None:
        """The tokens of block ``index``; None while they are not all in, or not known."""
        start = (index - len(self.prompt_blocks)) * block_tokens
        if start < 0:
            known = self.prompt_tokens[index * block_tokens : (index + 1) * block_tokens]
        else:  # the chain's: the prompt's tail, then the output
            tail = len(self.prompt_tail)
            known = self.prompt_tail[start : start + block_tokens]
            if len(known) < block_tokens:
                first = max(start - tail, 0)
                known += tuple(self.generated[first : first + block_tokens - len(known)])
        return known if len(known) == block_tokens else None

    def block_of(self, compat_id: str, index: int) -> BlockId | None:
        """Block ``index`` of the session, in its scope; None while its tokens are not all in."""
        key = self.key_of(index)
        return None if key is None else (compat_id, self.chain.scope_of(index), key)

    def checkpoint(self, compat_id: str) -> SessionCheckpoint:
        n = len(self.generated)
        return SessionCheckpoint(
            session=self.session,
            epoch=self.epoch,
            compat_id=compat_id,
            scope_id=self.tenant.scope_id,
            prompt_blocks=self.prompt_blocks,
            prompt_tail=self.prompt_tail,
            generated=tuple(self.generated),
            output_offset=n,
            sampler=self.sampler.model_copy(update={"step": n}),
            last_block=None if n or self.prompt_tail else self.last_block,
        )

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached.values())

    def summary(self) -> dict[str, Any]:
        """The last line of the session's stream."""
        return {
            "done": True,
            "epoch": self.epoch,
            "cached_tokens": self.cached_tokens,
            "cached": self.cached,
            "kv_hints": [o.to_json() for o in self.hint_outcomes],
            "generated": len(self.generated),
            "error": self.error or self.unacknowledged(),
            "moved": self.cancelled == MOVED,
        }

    def unacknowledged(self) -> str | None:
        """Why a finished session's stream stops short: tokens that no controller
        acknowledged may not be released (KVSP 6.8); the reader must fail, not end."""
        held = len(self.generated) - self.released
        if held <= 0 or self.cancelled == MOVED:
            return None
        return f"{held} generated tokens were never acknowledged by a controller"

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
