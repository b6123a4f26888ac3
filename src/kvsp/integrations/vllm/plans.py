"""What the connector does for each request and step, decided without vLLM (pure).

The scheduler side of ``KVSPConnector`` keeps one ``TrackedRequest`` per request it serves for
a tenant: the request's Block Keys (a ``ScopedChain`` fed as tokens become known, so that the
blocks of a shared public prefix are keyed in its shared scope; or, for a
resumed session, the keys it was given for a prefix whose token ids are not known here), how far
its KV is settled (loaded, or saved), and the blocks to load once vLLM has allocated room. Each
engine step it turns into ``RequestPlan`` entries that the worker side executes: blocks to load
(with the replica records to fetch them from, best first) and blocks whose tokens this step
completes (to save). Token positions map to vLLM's pages through the request's vLLM block ids;
KVSP blocks never straddle a vLLM block because vLLM's block size must be a multiple of KVSP's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsp.core.ids import CompatId, parse_block_key
from kvsp.core.problems import ConfigurationError
from kvsp.core.records import ReplicaRecord
from kvsp.core.shared import ScopedChain
from kvsp.tenants import Tenant

__all__ = [
    "BlockLoad",
    "BlockSave",
    "RequestPlan",
    "TrackedRequest",
    "check_block_sizes",
    "fetch_ranges",
    "matchable_tokens",
]


def check_block_sizes(kvsp_tokens: int, vllm_tokens: int) -> None:
    """vLLM's pages must hold whole KVSP blocks, so a block never spans two pages."""
    if vllm_tokens % kvsp_tokens:
        raise ConfigurationError(
            f"vLLM block size {vllm_tokens} is not a multiple of the KVSP block size {kvsp_tokens}"
        )


def matchable_tokens(prompt_tokens: int, block_tokens: int) -> int:
    """Prompt tokens whose KV may come from outside: whole blocks, never the last token (its
    logits start the output, so vLLM computes it)."""
    return max(0, prompt_tokens - 1) // block_tokens * block_tokens


def fetch_ranges(record: ReplicaRecord, start: int, chunk: int) -> list[tuple[int, int]]:
    """The layer ranges to GET, from layer ``start`` on: one per run of layers the holder keeps
    in one tier (a range never mixes a fast tier with a slow one, and the first layers, often
    in the faster tier, come first), each cut to ``chunk`` layers when ``chunk`` is set."""
    spans = sorted((r.layers[0], r.layers[1]) for r in record.residency)
    out: list[tuple[int, int]] = []
    for first, last in spans:
        first = max(first, start)
        while first <= last:
            end = last if not chunk else min(last, first + chunk - 1)
            out.append((first, end))
            first = end + 1
    return out


@dataclass(frozen=True, slots=True)
class BlockLoad:
    key: str
    first_token: int
    #: where the block may be fetched, in the order to try
    records: tuple[ReplicaRecord, ...]


@dataclass(frozen=True, slots=True)
class BlockSave:
    key: str
    first_token: int
    #: the block's scope: the tenant's, or a shared prefix's
    scope_id: str


@dataclass(frozen=True)
class RequestPlan:
    """One request's part of a step, for the worker side."""

    request: str
    compat_id: str
    #: the request's vLLM block ids, in token order
    pages: tuple[int, ...]
    loads: tuple[BlockLoad, ...] = ()
    saves: tuple[BlockSave, ...] = ()

    def page_of(self, token: int, page_tokens: int) -> tuple[int, int]:
        """The vLLM block id holding ``token`` and the token's offset in it."""
        return self.pages[token // page_tokens], token % page_tokens


@dataclass
class TrackedRequest:
    """A request served for one tenant: its keys and how far its KV is settled."""

    compat_id: CompatId
    block_tokens: int
    chain: ScopedChain
    #: keys given for the leading blocks (a resumed session), whose token ids are placeholders
    given: tuple[str, ...] = ()
    #: tokens fed into ``chain`` (counted from the start of the request)
    fed: int = 0
    #: blocks before this one are loaded, computed elsewhere or saved: never saved again
    settled: int = 0
    #: blocks to load once room is allocated, and the tokens they cover
    pending: tuple[BlockLoad, ...] = ()
    #: where the loaded tokens start (what vLLM had), and how many were loaded
    load_start: int = 0
    loaded_tokens: int = 0
    #: vLLM pages whose KVSP blocks were reported to ``full_pages``'s caller
    pages_keyed: int = 0
    #: the last lookup: (tokens vLLM had, matched blocks with their records)
    lookup: tuple[int, tuple[BlockLoad, ...]] | None = field(default=None, repr=False)

    @classmethod
    def start(
        cls, tenant: Tenant, compat_id: CompatId, block_tokens: int, given: Sequence[str] = ()
    ) -> TrackedRequest:
        checked = [parse_block_key(key) for key in given]  # InvalidInput for a malformed one
        given = [key.hex() for key in checked]
        chain = tenant.chain_after(compat_id.hex(), block_tokens, given)
        n = len(given)
        return cls(
            compat_id, block_tokens, chain, tuple(given), n * block_tokens, settled=n,
        )  # fmt: skip

    def scope_of(self, index: int) -> str:
        """The scope of block ``index``: a shared prefix's, or the tenant's."""
        return self.chain.scope_of(index)

    def keys(self, tokens: Sequence[int]) -> list[str]:
        """Keys of every complete block of ``tokens`` (the request's tokens so far)."""
        if len(tokens) > self.fed:
            self.chain.extend(list(tokens[self.fed :]))
            self.fed = len(tokens)
        return list(self.given) + [k.hex() for k in self.chain.keys]

    def wanted(self, tokens: Sequence[int], computed: int) -> list[str]:
        """Keys worth looking up: after what vLLM has (``computed`` tokens), up to what may
        come from outside."""
        end = matchable_tokens(len(tokens), self.block_tokens) // self.block_tokens
        start = computed // self.block_tokens
        return self.keys(tokens)[start:end] if start < end else []

    def allocated(self, computed: int, external: int) -> None:
        """vLLM made room: ``external`` tokens after ``computed`` come from the last lookup."""
        b = self.block_tokens
        if external and self.lookup is not None:
            loads = self.lookup[1][: external // b]
            self.pending = tuple(
                BlockLoad(load.key, computed + i * b, load.records) for i, load in enumerate(loads)
            )
            self.load_start, self.loaded_tokens = computed, external
        self.settled = max(self.settled, (computed + external) // b)
        self.lookup = None

    def load_failed(self, pages: Sequence[int], invalid: set[int], page_tokens: int) -> None:
        """vLLM recomputes from the first loaded page that failed: only the tokens before it
        count as loaded, and the blocks after it are saved again once recomputed."""
        if not self.loaded_tokens:
            return
        first = self.load_start // page_tokens
        last = (self.load_start + self.loaded_tokens - 1) // page_tokens
        for page in range(first, min(last + 1, len(pages))):
            if pages[page] in invalid:
                kept = max(0, page * page_tokens - self.load_start)
                self.loaded_tokens = kept
                self.settled = min(self.settled, (self.load_start + kept) // self.block_tokens)
                return

    def step(
        self, tokens: Sequence[int], done: int
    ) -> tuple[tuple[BlockLoad, ...], list[BlockSave]]:
        """Loads due now, and the blocks whose tokens are all computed once this step has
        computed up to token ``done``."""
        loads, self.pending = self.pending, ()
        b = self.block_tokens
        complete = min(done, len(tokens)) // b
        saves: list[BlockSave] = []
        if complete > self.settled:
            keys = self.keys(tokens[: complete * b])
            saves = [
                BlockSave(keys[i], i * b, self.scope_of(i)) for i in range(self.settled, complete)
            ]
            self.settled = complete
        return loads, saves

    def full_pages(
        self, tokens: Sequence[int], hashed: int, page_tokens: int
    ) -> list[tuple[int, list[tuple[str, str]]]]:
        """The request's full vLLM pages not yet reported, each with its KVSP blocks as
        (scope, key), in order: vLLM hashed the first ``hashed`` pages of ``tokens``."""
        pages = min(hashed, len(tokens) // page_tokens)
        if pages <= self.pages_keyed:
            return []
        per = page_tokens // self.block_tokens
        keys = self.keys(tokens[: pages * page_tokens])
        out = [
            (p, [(self.scope_of(i), keys[i]) for i in range(p * per, (p + 1) * per)])
            for p in range(self.pages_keyed, pages)
        ]
        self.pages_keyed = pages
        return out
