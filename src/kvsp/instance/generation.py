"""The reference engine's generation loop: the prompt's rest computed in chunks, then one
decode step at a time, each in the session's tenant's turn on the engine thread (``FairWorker``),
so tenants share the engine fairly and a cancelled session stops between steps.

Each decode step exports the blocks completed so far, samples the next token and computes the
logits after it, all on the engine thread; the loop hands blocks and tokens to the service on
the event loop. The measured prefill and decode rates go into the status record (KVSP 6.4).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvsp.instance.engine import Engine, KvState
from kvsp.instance.fair import FairWorker
from kvsp.instance.sampling import next_token
from kvsp.instance.sessions import Session

__all__ = ["EngineRates", "generate"]

T = TypeVar("T")


@dataclass
class EngineRates:
    """What the engine was last measured at (tokens per second), reported in the status."""

    prefill: float = 400.0
    decode: float = 15.0


class _Timed:
    """Calls a function and adds up how long its calls took (the engine's own time, without
    the turns of other tenants)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.last_s = 0.0

    def __call__(self, fn: Callable[..., T], *args: Any) -> T:
        started = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.last_s = time.perf_counter() - started
            self.total_s += self.last_s


async def generate(
    engine: Engine,
    worker: FairWorker,
    session: Session,
    state: KvState,
    rest: list[int],
    first_step: int,
    prefill_chunk: int,
    rates: EngineRates,
    on_block: Callable[[Session, int, bytes], None],
    on_token: Callable[[Session, int], None],
) -> None:
    """Compute ``rest`` (the prompt after the loaded blocks), then generate from step
    ``first_step`` until a stop token, ``max_tokens`` or a cancellation."""
    b = engine.block_tokens
    tenant = session.tenant.name
    exported = len(state) // b  # blocks already held (imported)
    timed = _Timed()

    def decode_step(
        logits: npt.NDArray[np.float32], step: int
    ) -> tuple[list[tuple[int, bytes]], int, npt.NDArray[np.float32] | None]:
        """The blocks completed so far, the next token, and the logits after it (None once
        the session stops there)."""
        nonlocal exported
        blocks = []
        while exported < len(state) // b:
            blocks.append((exported, engine.export_block(state, exported).tobytes()))
            exported += 1
        token = next_token(logits, session.sampler, step)
        if token in engine.stop_ids or step + 1 >= session.max_tokens:
            return blocks, token, None
        after = timed(engine.forward, state, [token])
        rates.decode = 1 / max(timed.last_s, 1e-6)
        return blocks, token, after

    logits = None
    for at in range(0, len(rest), prefill_chunk):
        chunk = rest[at : at + prefill_chunk]
        logits = await worker.run(tenant, functools.partial(timed, engine.forward, state, chunk))
        session.begun = True
        if session.cancelled is not None:
            break
    if len(rest) > 1:
        rates.prefill = len(rest) / max(timed.total_s, 1e-6)
    step = first_step
    while logits is not None and step < session.max_tokens:
        if session.cancelled is not None:
            break
        blocks, token, logits = await worker.run(
            tenant, functools.partial(decode_step, logits, step)
        )
        session.begun = True
        for index, body in blocks:
            on_block(session, index, body)
        on_token(session, token)
        step += 1
