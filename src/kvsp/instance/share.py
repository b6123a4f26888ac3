"""Share's transfer, one piece for every executor: each block PUT to the destination (which
verifies it and publishes it only once it has all of it), counted in the outcome; the first
refusal ends it with ``unreachable`` (``clipped`` when some blocks went, ``deferred`` when none
did). A block the destination already holds counts as shared."""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable

from kvsp.core.container import Container
from kvsp.core.hints import HintOutcome, Outcome, Reason
from kvsp.core.problems import AlreadyStored, KvspError
from kvsp.holder.blocks import BlockId
from kvsp.holder.client import HolderClient

__all__ = ["share_blocks"]


async def share_blocks(
    peers: HolderClient,
    destination: str,
    outcome: HintOutcome,
    blocks: AsyncIterable[tuple[BlockId, Container]],
    copied: Callable[[BlockId, int], None],
) -> HintOutcome:
    async for block, container in blocks:
        try:
            await peers.put(destination, block, container)
        except AlreadyStored:
            pass
        except KvspError as exc:
            said: Outcome = "clipped" if outcome.blocks else "deferred"
            outcome.note(said, Reason.UNREACHABLE, f"{destination}: {exc.detail}")
            break
        outcome.blocks += 1
        copied(block, container.size)
    return outcome
