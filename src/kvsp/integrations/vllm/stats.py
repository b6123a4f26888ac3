"""KVSPConnector's figures in vLLM's own ``/metrics``, through vLLM's KV-connector stats: the
workers count what they loaded from holders and stored at them (``ConnectorTally``), vLLM
carries each step's counts to its logging process (``KVSPConnectorStats``, a plain dict of
integers, as vLLM requires), and ``KVSPPromMetrics`` adds them to ``vllm:kvsp_*`` counters
labelled per engine as vLLM labels its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTS", "ConnectorTally", "KVSPConnectorStats", "KVSPPromMetrics"]

#: each count, and what its ``vllm:kvsp_<name>_total`` counter says
COUNTS = {
    "blocks_loaded": "KVSP blocks loaded into vLLM's pages, every digest verified",
    "bytes_loaded": "Octets of KVSP blocks loaded into vLLM's pages",
    "blocks_loaded_locally": "KVSP blocks read from a holder in the same process",
    "load_failures": "KVSP blocks that no holder served intact (recomputed)",
    "blocks_stored": "KVSP blocks stored at a holder",
    "bytes_stored": "Octets of KVSP blocks stored at a holder",
    "store_failures": "KVSP block stores a holder refused or did not answer",
}


@dataclass
class KVSPConnectorStats(KVConnectorStats):
    """One interval's counts (``data``: count name -> integer)."""

    def __post_init__(self) -> None:
        self.data = {name: int(self.data.get(name, 0)) for name in COUNTS}

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTS:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class ConnectorTally:
    """Counts a worker adds from its connector loop's thread and vLLM's thread takes each
    step (``take``): one lock, so no count is lost between the two."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, count in counts.items():
                self._counts[name] += count

    def take(self) -> KVSPConnectorStats | None:
        """The counts since the last take, or None when there are none."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(COUNTS, 0)
        return KVSPConnectorStats(counts) if any(counts.values()) else None


class KVSPPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvsp_<count>_total``, one child per engine."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvsp_{name}", documentation=text, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, text in COUNTS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self._counters.items():
            count = int(transfer_stats_data.get(name, 0))
            if count:
                per_engine[engine_idx].inc(count)  # type: ignore[union-attr]
