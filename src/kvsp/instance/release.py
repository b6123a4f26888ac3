"""When an output token may be released to a reader (KVSP 6.8), pure: one session's gate.

A token leaves the instance only once a resume elsewhere would repeat it. With a deterministic
sampler, or with no controller to take checkpoints, that holds as soon as it is generated: it
is released at once, and a checkpoint goes every ``checkpoint_every`` tokens. With any other
sampler it holds only for the tokens a checkpoint the controller acknowledged covers: tokens
wait, and a checkpoint goes once ``release_batch`` of them are unacknowledged, which bounds
the wait. A completed block always sends one (where a session's KV is held changes).

The service feeds the gate what happened (``on_token``, ``on_block``, ``on_ack``) and does
what it answers; every rule of the release lives here, testable without an engine or a network.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReleaseGate"]


@dataclass
class ReleaseGate:
    #: tokens wait for an acknowledged checkpoint (a controller, and a sampler that is not
    #: deterministic)
    gated: bool
    #: a controller takes checkpoints
    checkpoints: bool
    release_batch: int = 4
    checkpoint_every: int = 64
    #: tokens generated, released to readers, and covered by an acknowledged checkpoint
    generated: int = 0
    released: int = 0
    acknowledged: int = 0

    @classmethod
    def resumed(cls, gated: bool, checkpoints: bool, offset: int, **limits: int) -> ReleaseGate:
        """The gate of a session resumed at ``offset``: every token before it was released and
        acknowledged where it was served."""
        return cls(gated, checkpoints, generated=offset, released=offset, acknowledged=offset,
                   **limits)  # fmt: skip

    def on_token(self) -> bool:
        """One more token was generated; whether to send a checkpoint now."""
        self.generated += 1
        if not self.gated:
            self.released = self.generated
            return self.checkpoints and self.generated % self.checkpoint_every == 0
        return self.generated - self.acknowledged >= self.release_batch

    def on_block(self) -> bool:
        """A block of the session is complete; whether to send a checkpoint now."""
        return self.checkpoints

    def on_ack(self, acknowledged: int) -> None:
        """The controller acknowledged a checkpoint up to ``acknowledged``: release what it
        covers, never past what was generated, whatever the controller says."""
        self.acknowledged = max(self.acknowledged, acknowledged)
        self.released = max(self.released, min(self.acknowledged, self.generated))
