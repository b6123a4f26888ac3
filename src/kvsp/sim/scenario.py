"""Simulated clusters as files, pure: a scenario says what the instances are (prefill rate,
decode step, G1 and G2 sizes), how they are linked, which standalone holders they have, when
instances start or fail, and what the controller assumes. Every number has a default here and,
in the shipped scenarios (``kvsp/sim/scenarios/*.toml``), a written source.

A scenario file is TOML::

    name = "16 x H100-class, 8B model"
    [model]      layers, kv_heads, head_dim, element_octets, block_tokens
    [instances]  count, prefill_tokens_per_s, attention_ns_per_pair, decode_step_ms,
                 decode_ms_per_gbyte, g1_blocks, g2_blocks, host_read_mbit_per_s,
                 ingress_mbit_per_s, import_mbit_per_s, overhead_ms
    [links]      mbit_per_s, rtt_us            (every pair, unless a [[links.pair]] says else)
    [holders]    count, blocks, read_mbit_per_s (each instance copies every block it
                 computes to one of them, chosen by the block's key)
    [controller] mean_service_ms, ttft_slo_ms, record_ttl_ms
    [[starts]]   instance, at_ms               (an instance joins late)
    [[failures]] instance, at_ms               (an instance dies)

Unknown tables or keys are errors: a misspelt key silently falling back to a default would
make a run measure something else than its file says.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvsp.core.config import load_toml
from kvsp.core.container import FIXED_HEADER_OCTETS
from kvsp.core.ids import CompatId
from kvsp.core.problems import ConfigurationError

__all__ = [
    "DEFAULT_SCENARIO",
    "ControllerSpec",
    "HolderSpec",
    "InstanceSpec",
    "LinkSpec",
    "ModelShape",
    "Moment",
    "PairLink",
    "Scenario",
    "load_scenario",
    "shipped",
]

#: the scenario ``kvsp sim`` uses when none is given
DEFAULT_SCENARIO = "h100-8b-16"


@dataclass(frozen=True)
class ModelShape:
    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    element_octets: int = 2
    #: tokens per KVSP block
    block_tokens: int = 512

    @property
    def token_octets(self) -> int:
        """KV octets of one token over all layers (K and V)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.element_octets

    @property
    def section_octets(self) -> int:
        """Octets of one layer's K (or V) section of a whole block."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.element_octets

    @property
    def block_octets(self) -> int:
        """Octets of a whole block's container, as its Replica Record states them."""
        return FIXED_HEADER_OCTETS + 16 * self.layers + 2 * self.layers * self.section_octets

    @property
    def compat_id(self) -> CompatId:
        """A Compatibility ID standing for this geometry (simulated blocks have no model)."""
        doc = json.dumps(asdict(self), sort_keys=True).encode()
        return CompatId(hashlib.sha256(b"kvsp simulated model " + doc).digest())


@dataclass(frozen=True)
class InstanceSpec:
    count: int = 16
    #: prompt tokens per second, attention aside ...
    prefill_tokens_per_s: float = 15_000.0
    #: ... plus this per (new token, token it attends to) pair: attention grows with context
    attention_ns_per_pair: float = 0.0
    #: a decode step with nothing in the batch (the weights are read once per step) ...
    decode_step_ms: float = 6.0
    #: ... plus this per GB of KV the batch reads (HBM bandwidth)
    decode_ms_per_gbyte: float = 0.3
    g1_blocks: int = 800
    g2_blocks: int = 3_000
    #: G2 -> G1 copy rate (host to device)
    host_read_mbit_per_s: float = 200_000.0
    #: what an instance can receive at once, from all sources together (0: no limit beyond
    #: each link's own rate)
    ingress_mbit_per_s: float = 0.0
    #: how fast the engine turns reused KV (its own or fetched) into its attention cache
    #: (0: used in place, as paged GPU engines do)
    import_mbit_per_s: float = 0.0
    #: time a request spends outside prefill before its first token (HTTP, placement,
    #: scheduling), added to each one
    overhead_ms: float = 0.0


@dataclass(frozen=True)
class LinkSpec:
    mbit_per_s: float = 200_000.0
    rtt_us: int = 10


@dataclass(frozen=True)
class PairLink:
    a: int
    b: int
    mbit_per_s: float
    rtt_us: int


@dataclass(frozen=True)
class HolderSpec:
    count: int = 0
    blocks: int = 0
    read_mbit_per_s: float = 200_000.0


@dataclass(frozen=True)
class ControllerSpec:
    #: the placement's assumed service time per queued request (``wait_us``); 0: the mean
    #: prompt of the workload at the prefill rate
    mean_service_ms: float = 0.0
    ttft_slo_ms: float = 2_000.0
    record_ttl_ms: int = 3_600_000


@dataclass(frozen=True)
class Moment:
    instance: int
    at_ms: int


@dataclass(frozen=True)
class Scenario:
    name: str = "unnamed"
    model: ModelShape = field(default_factory=ModelShape)
    instances: InstanceSpec = field(default_factory=InstanceSpec)
    links: LinkSpec = field(default_factory=LinkSpec)
    pairs: tuple[PairLink, ...] = ()
    holders: HolderSpec = field(default_factory=HolderSpec)
    controller: ControllerSpec = field(default_factory=ControllerSpec)
    starts: tuple[Moment, ...] = ()
    failures: tuple[Moment, ...] = ()

    def link(self, a: int, b: int) -> tuple[float, int]:
        """(Mbit/s, RTT µs) between two nodes (instances first, then holders)."""
        for pair in self.pairs:
            if {pair.a, pair.b} == {a, b}:
                return pair.mbit_per_s, pair.rtt_us
        return self.links.mbit_per_s, self.links.rtt_us

    def with_sizes(self, scale: float) -> Scenario:
        """The same cluster with G1, G2 and holders scaled (for hit rate vs cache size)."""
        inst = self.instances
        return replace(
            self,
            instances=replace(
                inst,
                g1_blocks=max(1, round(inst.g1_blocks * scale)),
                g2_blocks=round(inst.g2_blocks * scale),
            ),
            holders=replace(self.holders, blocks=round(self.holders.blocks * scale)),
        )

    def check(self) -> Scenario:
        m, i = self.model, self.instances
        positive: list[float] = [m.layers, m.kv_heads, m.head_dim, m.element_octets, m.block_tokens]
        positive += [i.count, i.g1_blocks, i.prefill_tokens_per_s, i.host_read_mbit_per_s]
        positive += [self.links.mbit_per_s, self.controller.ttft_slo_ms]
        if min(positive) <= 0:
            raise ConfigurationError(f"scenario {self.name}: sizes and rates must be positive")
        if (
            min(
                i.g2_blocks,
                self.holders.count,
                self.holders.blocks,
                i.decode_step_ms,
                i.overhead_ms,
            )
            < 0
        ):
            raise ConfigurationError(f"scenario {self.name}: counts must not be negative")
        nodes = i.count + self.holders.count
        for pair in self.pairs:
            if not (0 <= pair.a < nodes and 0 <= pair.b < nodes) or pair.mbit_per_s <= 0:
                raise ConfigurationError(f"scenario {self.name}: bad link {pair}")
        for moment in self.starts + self.failures:
            if not 0 <= moment.instance < i.count or moment.at_ms < 0:
                raise ConfigurationError(f"scenario {self.name}: no instance {moment.instance}")
        return self


def _build(kind: type[Any], doc: Any, where: str) -> Any:
    if not isinstance(doc, dict):
        raise ConfigurationError(f"{where} must be a table")
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ConfigurationError(f"{where}: unknown keys {unknown}")
    numbers = [k for k, v in doc.items() if isinstance(v, bool) or not isinstance(v, int | float)]
    if numbers:
        raise ConfigurationError(f"{where}: {numbers} must be numbers")
    try:
        return kind(**doc)
    except TypeError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None


def _list(kind: type[Any], docs: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(docs, list):
        raise ConfigurationError(f"{where} must be an array of tables")
    return tuple(_build(kind, d, f"{where}[{n}]") for n, d in enumerate(docs))


def load_scenario(source: Path | str) -> Scenario:
    """A scenario from a TOML file, or a shipped one by name (see ``shipped``)."""
    path = Path(source)
    if not path.suffix and str(source) in shipped():
        text = resources.files("kvsp.sim").joinpath(f"scenarios/{source}.toml").read_text()
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigurationError(f"cannot read scenario {source}: {exc.strerror}") from None
    doc = load_toml(text, f"scenario {source}")
    tables = {
        "model": ModelShape,
        "instances": InstanceSpec,
        "holders": HolderSpec,
        "controller": ControllerSpec,
    }
    unknown = sorted(set(doc) - {"name", "links", "starts", "failures", *tables})
    if unknown:
        raise ConfigurationError(f"scenario {source}: unknown tables {unknown}")
    links = dict(doc.get("links", {}))
    pairs = links.pop("pair", [])
    built = {name: _build(kind, doc.get(name, {}), name) for name, kind in tables.items()}
    return Scenario(
        name=str(doc.get("name", Path(str(source)).stem)),
        links=_build(LinkSpec, links, "links"),
        pairs=_list(PairLink, pairs, "links.pair"),
        starts=_list(Moment, doc.get("starts", []), "starts"),
        failures=_list(Moment, doc.get("failures", []), "failures"),
        **built,
    ).check()


def shipped() -> list[str]:
    """Names of the scenarios that come with kvsp."""
    folder = resources.files("kvsp.sim").joinpath("scenarios")
    return sorted(
        p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml")
    )
