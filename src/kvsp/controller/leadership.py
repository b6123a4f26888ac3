"""Which controller leads: a lease in the control store, renewed by its holder, taken by a
standby once it lapses (decision 0019).

The leader may act only while ``check`` passes: it holds a fencing token and its lease has not
run out by its own clock, measured from before the renewal was sent (Redis counts the lease
from when it received it, later), so a leader stops acting before Redis could give the lease
to anyone else. Its writes carry the token, and the store refuses those of a token that a newer
leader has fenced out, so a leader stalled past its lease changes nothing either.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from kvsp.controller.stores import ControlStore
from kvsp.core.problems import ConfigurationError, KvspError, NotLeader
from kvsp.tasks import Background

__all__ = ["Leadership"]

log = logging.getLogger("kvsp.controller")


class Leadership:
    def __init__(
        self,
        store: ControlStore,
        me: str,
        lease_ms: int,
        elected: Callable[[int], Awaitable[None]],
        deposed: Callable[[], None],
    ) -> None:
        """``elected(token)`` loads the state once the lease is taken (leading starts after
        it returns); ``deposed()`` drops the state when the lease is lost."""
        if lease_ms < 100:
            raise ConfigurationError("the controller lease must be at least 100 ms")
        self.store = store
        self.me = me
        self.lease_ms = lease_ms
        self._elected = elected
        self._deposed = deposed
        self.token: int | None = None
        #: the leader as last seen (this controller's URL while it leads)
        self.leader: str | None = None
        self._until = 0.0
        #: leaderships this process has taken, and lost
        self.elections = 0
        self.depositions = 0
        self._releases = Background(log, logging.INFO)
        #: the memory store has one controller, which leads for good
        self.permanent = store.name == "memory"
        if self.permanent:
            self.token, self.leader, self._until = 0, me, math.inf

    @property
    def period_s(self) -> float:
        """How often the lease is renewed, or a standby tries to take it."""
        return self.lease_ms / 5000

    def leading(self) -> bool:
        return self.token is not None and time.monotonic() < self._until

    def check(self) -> int:
        """The fencing token to write with; ``NotLeader`` (naming the leader) unless this
        controller leads now."""
        if self.token is None or time.monotonic() >= self._until:
            extensions = {} if self.leader in (None, self.me) else {"leader": self.leader}
            raise NotLeader("this controller is a standby; another one leads", **extensions)
        return self.token

    def depose(self, why: str) -> None:
        """Stop leading now (a write was fenced out, or the state could not be written):
        the tables are dropped and reloaded by whoever takes the lease next."""
        if self.token is None:
            return
        log.warning("controller %s stops leading: %s", self.me, why)
        token, self.token = self.token, None
        self.depositions += 1
        self._deposed()
        self._release_later(token)

    def _release_later(self, token: int) -> None:
        self._releases.run(self.store.release(token, self.me), "lease not released")

    async def step(self) -> None:
        """Renew the lease, or try to take it."""
        if self.permanent:
            return
        started = time.monotonic()
        if self.token is not None:
            try:
                kept = await self.store.renew(self.token, self.me, self.lease_ms)
            except KvspError as exc:
                if time.monotonic() >= self._until:
                    self.depose(f"lease not renewed in time ({exc.detail})")
                return
            if kept:
                self._until = started + self.lease_ms / 1000
            else:
                self.depose("the lease was taken over")
            return
        token, holder = await self.store.acquire(self.me, self.lease_ms)
        self.leader = holder
        if token is None:
            return
        try:
            await self._elected(token)
        except BaseException:
            self._deposed()
            self._release_later(token)
            raise
        self.token, self._until = token, started + self.lease_ms / 1000
        self.elections += 1
        log.warning("controller %s leads (fencing token %d)", self.me, token)

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except KvspError as exc:
                log.warning("leadership round failed: %s", exc.detail)
            await asyncio.sleep(self.period_s)

    async def close(self) -> None:
        """Hand the lease back at a clean shutdown, so a standby takes over at once (and
        finish the hand-backs of leaderships lost before it)."""
        await self._releases.drain()
        if self.token is not None and not self.permanent:
            token, self.token = self.token, None
            try:
                await self.store.release(token, self.me)
            except KvspError as exc:
                log.info("lease not released: %s", exc.detail)
