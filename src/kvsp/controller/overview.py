"""What the live cluster page shows beside the instances and sessions: the last placements,
each with every candidate's cost terms, and how much of the placed prompts' blocks the chosen
instances could reuse, per tenant. Kept by the leader as it decides (a bounded ring), never
stored: a new leader's page starts empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PlacementLog"]


@dataclass
class PlacementLog:
    """The last ``keep`` placements and, per tenant, prompt blocks placed and reused."""

    keep: int = 50
    _recent: deque[dict[str, Any]] = field(init=False)
    _blocks: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.keep)

    def record(self, at_ms: int, tenant: str, prompt_blocks: int, decision: dict[str, Any]) -> None:
        """A placement was decided (``decision``: ``Decision.to_json()``)."""
        self._recent.append({"at_ms": at_ms, "tenant": tenant, "blocks": prompt_blocks,
                             **decision})  # fmt: skip
        placed = self._blocks.setdefault(tenant, [0, 0])
        placed[0] += prompt_blocks
        placed[1] += min(int(decision.get("reused_blocks", 0)), prompt_blocks)

    def recent(self) -> list[dict[str, Any]]:
        """The last placements, newest first."""
        return list(reversed(self._recent))

    def hit_rates(self) -> dict[str, dict[str, float | int]]:
        """Per tenant: prompt blocks placed, blocks the chosen instance could reuse, and the
        share."""
        return {
            tenant: {
                "blocks": placed,
                "reused": reused,
                "hit_rate": reused / placed if placed else 0.0,
            }
            for tenant, (placed, reused) in sorted(self._blocks.items())
        }
