"""What an instance is configured with: its pool's tiers, its peers, its session and release
rules, its limits. The CLI's defaults come from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvsp.instance.hints import HintLimits
from kvsp.kvevents.publisher import PublisherConfig
from kvsp.tenants import Tenants

__all__ = ["InstanceConfig"]


@dataclass(frozen=True)
class InstanceConfig:
    url: str
    tenants: Tenants
    #: G1 capacity in blocks (KV pages of the engine)
    g1_blocks: int = 256
    #: leading layers of each block kept in G1 (None: all); the rest go to G2
    g1_layers: int | None = None
    g2_bytes: int = 1 << 30
    #: the rate G2 is read at, reported in Replica Records (memcpy on these machines)
    g2_read_mbit_per_s: float = 96_000.0
    block_tokens: int = 16
    #: the controller's base URL; several, separated by commas, for controllers sharing one
    #: state (decision 0019): a standby sends the instance on to the leader
    controller_url: str | None = None
    index_url: str | None = None
    #: this instance's bearer token for the controller, the IS and other holders
    token: str | None = None
    offload_url: str | None = None
    status_ttl_ms: int = 3_000
    #: the TTL of the pool's Replica Records, refreshed while held: how long the IS may still
    #: name a block of a process that died
    record_ttl_ms: int = 600_000
    release_batch: int = 4
    checkpoint_every: int = 64
    max_tokens: int = 256
    #: prompt tokens per engine turn: between turns other tenants' steps run, and a cancelled
    #: session stops
    prefill_chunk: int = 512
    #: finished sessions whose tokens stay readable (oldest forgotten first)
    max_sessions: int = 1024
    model_home: Path | None = None
    threads: int | None = None
    #: ask the controller to sleep after this long with nothing to do (None: never)
    sleep_after_s: float | None = None
    #: keep the SessionPrefixIndex (KvHints may then target sessions)
    session_index: bool = False
    hint_limits: HintLimits = field(default_factory=HintLimits)
    #: events kept for consumers that fall behind
    events: int = 4096
    #: vLLM-format KV events over ZMQ (None: not published); sequence numbers start from the
    #: epoch (``kvevents.publisher.epoch_seq``)
    kv_events: PublisherConfig | None = None
