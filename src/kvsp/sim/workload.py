"""What a simulated cluster is asked to do, pure: requests with arrival times, tenants,
sessions and the KVSP Block Keys of their prompts.

Three sources:

- ``from_trace``: a Mooncake trace replayed at its timestamps (optionally faster), ``copies``
  times over as that many tenants, each with its own scope key (so no block is shared between
  tenants) and each copy shifted in time by ``duration / copies`` so the load is even. A
  request continues a session when its hash ids start with all whole-block ids of an earlier
  request of the tenant (the previous turn's prompt is a prefix of this one).
- ``agentic``: multi-turn sessions sharing a system prompt; each turn appends the model's
  output and a user message or a tool result; a turn that ends in a tool call comes back after
  the tool's run time, the others after a user's think time.
- ``shared_prefix``: groups of prompts sharing a long system prompt with short questions
  (SGLang's ``generated_shared_prefix`` benchmark), arriving as a Poisson process.

Token ids are synthetic (a seeded generator); Block Keys are computed from them with the real
``BlockKeyChain`` under each tenant's scope key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsp.core.ids import CompatId
from kvsp.core.keys import BlockKeyChain
from kvsp.core.problems import ConfigurationError
from kvsp.sim.traces import TraceKeys, TraceRequest

__all__ = ["SimRequest", "agentic", "from_trace", "shared_prefix", "tenant_scope_key"]


@dataclass(slots=True)
class SimRequest:
    arrival_ms: float
    tenant: int
    session: str
    #: hex Block Keys of the prompt's whole blocks, root first
    keys: list[str]
    prompt_tokens: int
    output_tokens: int
    #: the turn ends in a tool call (the session comes back after the tool runs)
    tool_call: bool = False
    #: the session's last turn (known to generated workloads only)
    last: bool = False
    #: the instance it ran on, for replaying placements made elsewhere (``policies.Replay``)
    instance: int | None = None


def tenant_scope_key(tenant: int) -> bytes:
    """A tenant's scope key (32 octets, distinct per tenant)."""
    return hashlib.sha256(b"kvsp simulated tenant %d" % tenant).digest()


def from_trace(
    trace: Sequence[TraceRequest],
    compat: CompatId,
    block_tokens: int,
    copies: int = 1,
    rate_scale: float = 1.0,
    limit: int | None = None,
) -> list[SimRequest]:
    """The trace as requests, in arrival order (see module doc)."""
    if copies < 1 or rate_scale <= 0 or not trace:
        raise ConfigurationError("a replay needs a trace, copies >= 1 and a positive rate")
    duration = max(r.timestamp_ms for r in trace) + 1
    out: list[SimRequest] = []
    for copy in range(copies):
        keys = TraceKeys(tenant_scope_key(copy), compat, block_tokens)
        shift = copy * duration / copies
        sessions: dict[int, str] = {}  # last whole-block hash id of a prompt -> its session
        for n, request in enumerate(trace):
            whole = request.input_length // 512
            ids = request.hash_ids
            session = next(
                (sessions[ids[i]] for i in range(whole - 1, 0, -1) if ids[i] in sessions),
                f"t{copy}-s{n}",
            )
            if whole > 1:
                sessions[ids[whole - 1]] = session
            out.append(
                SimRequest(
                    ((request.timestamp_ms + shift) % duration) / rate_scale,
                    copy,
                    session,
                    keys.keys(request),
                    request.input_length,
                    max(request.output_length, 1),
                )
            )
    out.sort(key=lambda r: r.arrival_ms)
    return out[:limit]


class _Tokens:
    """Seeded synthetic token ids."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def take(self, count: int) -> npt.NDArray[np.uint32]:
        return self.rng.integers(100, 40_000, count, dtype=np.uint32)


def agentic(
    compat: CompatId,
    block_tokens: int,
    sessions: int = 200,
    turns: tuple[int, int] = (3, 12),
    session_rate_per_s: float = 1.0,
    system_tokens: int = 4_096,
    message_tokens: tuple[int, int] = (100, 1_500),
    output_tokens: tuple[int, int] = (50, 500),
    tool_share: float = 0.6,
    tool_ms: float = 8_000.0,
    think_ms: float = 40_000.0,
    tenants: int = 1,
    seed: int = 0,
) -> list[SimRequest]:
    """Agentic multi-turn sessions (see module doc)."""
    if sessions < 1 or not 1 <= turns[0] <= turns[1] or session_rate_per_s <= 0:
        raise ConfigurationError("agentic sessions need sessions >= 1, 1 <= turns and a rate")
    tokens = _Tokens(seed)
    system = [tokens.take(system_tokens) for _ in range(tenants)]
    rng = tokens.rng
    out: list[SimRequest] = []
    start = 0.0
    for s in range(sessions):
        start += rng.exponential(1_000.0 / session_rate_per_s)
        tenant = s % tenants
        chain = BlockKeyChain(tenant_scope_key(tenant), compat, block_tokens)
        keys = [k.hex() for k in chain.extend(system[tenant])]
        prompt = system_tokens
        at = start
        count = int(rng.integers(turns[0], turns[1] + 1))
        for turn in range(count):
            message = int(rng.integers(*message_tokens))
            keys += [k.hex() for k in chain.extend(tokens.take(message))]
            prompt += message
            output = int(rng.integers(*output_tokens))
            tool = bool(rng.random() < tool_share)
            last = turn == count - 1
            out.append(
                SimRequest(at, tenant, f"a{s}", list(keys), prompt, output, tool and not last, last)
            )
            keys += [k.hex() for k in chain.extend(tokens.take(output))]
            prompt += output
            # the next turn comes after this one's answer (estimated from its prompt) and a gap
            at += 0.1 * prompt + rng.exponential(tool_ms if tool else think_ms)
    out.sort(key=lambda r: r.arrival_ms)
    return out


def shared_prefix(
    compat: CompatId,
    block_tokens: int,
    groups: int = 64,
    prompts_per_group: int = 16,
    system_tokens: int = 2_048,
    question_tokens: int = 128,
    output_tokens: int = 256,
    rate_per_s: float = 16.0,
    seed: int = 0,
) -> list[SimRequest]:
    """SGLang's generated-shared-prefix workload with Poisson arrivals (see module doc)."""
    if groups < 1 or prompts_per_group < 1 or rate_per_s <= 0:
        raise ConfigurationError("a shared-prefix workload needs groups, prompts and a rate")
    tokens = _Tokens(seed)
    rng = tokens.rng
    prompts = []
    for g in range(groups):
        system = tokens.take(system_tokens)
        for q in range(prompts_per_group):
            chain = BlockKeyChain(tenant_scope_key(0), compat, block_tokens)
            keys = [k.hex() for k in chain.extend(system)]
            keys += [k.hex() for k in chain.extend(tokens.take(question_tokens))]
            prompts.append((f"g{g}-q{q}", keys))
    order = rng.permutation(len(prompts))
    at = 0.0
    out = []
    for i in order:
        at += rng.exponential(1_000.0 / rate_per_s)
        session, keys = prompts[int(i)]
        out.append(SimRequest(at, 0, session, keys, system_tokens + question_tokens, output_tokens))
    return out
