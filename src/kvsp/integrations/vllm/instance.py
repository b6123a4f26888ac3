"""The vLLM-backed inference instance (``kvsp instance serve --engine vllm``).

Same API and the same behaviour as the transformers instance, with vLLM's engine running in this
process: continuous batching over vLLM's own paged KV cache (G1, with vLLM's prefix cache kept
apart per tenant by a cache salt of the tenant's scope id), and ``KVSPConnector`` in it. The
connector finds a prompt's blocks through the Index Service, loads them into vLLM's pages, and
saves every block that vLLM completes to this instance's embedded holder (its G2 host tier,
served and published like any holder's, and what KvHints act on) and to the offload holder.

What differs, and why:

- **Generation** is driven by one thread that steps vLLM's engine; requests join and leave
  between steps, so sessions run in one batch. Tokens reach the session as vLLM streams them and
  follow the same release and checkpoint rules (KVSP 6.8).
- **Resume** of a session whose prompt token ids are not known (only its prompt block keys are,
  from the checkpoint): the blocks are first fetched, verified and held here, then vLLM gets
  placeholder tokens for that prefix with the keys passed to the connector, under a salt of its
  own so they never meet another prompt in vLLM's prefix cache. If vLLM reports fewer cached
  tokens than the prefix, the request is stopped before any token is released.
- **Sampling** follows kvsp's rule (step n drawn from the seed and n alone) through a logits
  processor (``KvspSampling``), so a sampled session resumes token for token, like a greedy one.
- **Sequence-sharded caches** (KVSP 6.9) need access to the engine's cache by token range, which
  vLLM does not offer: those routes answer 405.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsp.core.hints import KvHints
from kvsp.core.problems import NotFound, ServiceUnavailable
from kvsp.core.records import Sampler
from kvsp.holder import local as local_holders
from kvsp.holder.blocks import BlockId
from kvsp.holder.store import TierData
from kvsp.instance.config import InstanceConfig
from kvsp.instance.service import InstanceService
from kvsp.instance.sessions import Session
from kvsp.integrations.vllm.engine import vllm_environment
from kvsp.model import ModelBounds, ModelFiles

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.kv_hints import KvHintsEnvelope

    from kvsp.integrations.vllm.connector import KVSPConnector

__all__ = ["VllmInstanceService", "VllmOptions"]

log = logging.getLogger("kvsp.instance.vllm")
#: the token id standing in for prompt tokens whose KV is loaded, not computed
_PLACEHOLDER = 0

Handler = Callable[["RequestOutput | BaseException"], None]


@dataclass(frozen=True)
class VllmOptions:
    #: the tenants file (the connector reads the scope keys from it)
    tenants_file: Path
    #: tokens per vLLM KV page (a multiple of the KVSP block size)
    page_tokens: int = 128
    kv_cache_gib: int = 1
    #: vLLM's KV pages, fewer than fit ``kv_cache_gib`` (None: as many as fit); a prompt and its
    #: output must fit them but one (vLLM keeps a page aside), so they also bound the context
    pages: int | None = None
    #: the connector reads this instance's own holder in process (False: over HTTP, as any)
    local_reads: bool = True
    max_model_len: int = 4096

    @property
    def context_tokens(self) -> int:
        if self.pages is None:
            return self.max_model_len
        return min(self.max_model_len, (self.pages - 1) * self.page_tokens)


class _Driver:
    """Steps vLLM's engine on one thread. Requests are added and aborted between steps (the
    engine is not thread-safe); each request's outputs go to its handler, on this thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._handlers: dict[str, Handler] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="kvsp-vllm", daemon=True)
        self._thread.start()

    def add(
        self,
        request: str,
        prompt: Any,
        params: SamplingParams,
        handler: Handler,
        session: str | None = None,
        hints: KvHintsEnvelope | None = None,
    ) -> None:
        def job() -> None:
            self._handlers[request] = handler
            try:
                self.engine.add_request(request, prompt, params, session_id=session, kv_hints=hints)
            except Exception as exc:  # a request vLLM refuses ends alone, with the reason
                self._handlers.pop(request, None)
                handler(exc)

        self._inbox.put(job)

    def abort(self, request: str) -> None:
        def job() -> None:
            self.engine.abort_request([request])
            stopped = self._handlers.pop(request, None)
            if stopped is not None:
                stopped(ServiceUnavailable("the request was stopped"))

        self._inbox.put(job)

    def stop(self) -> None:
        self._stopped = True
        self._inbox.put(lambda: None)
        self._thread.join(10)

    def _loop(self) -> None:
        while not self._stopped:
            if not self._handlers:
                with contextlib.suppress(queue.Empty):
                    self._inbox.get(timeout=0.5)()
            while True:
                try:
                    self._inbox.get_nowait()()
                except queue.Empty:
                    break
            if not self._handlers:
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the engine failed: every request it had ends with it
                log.exception("vLLM step failed")
                handlers, self._handlers = self._handlers, {}
                for failed in handlers.values():
                    failed(exc)
                continue
            for output in outputs:
                handler = self._handlers.get(output.request_id)
                if handler is None:
                    continue
                if output.finished:
                    del self._handlers[output.request_id]
                handler(output)  # type: ignore[arg-type]  # generation requests only


@dataclass
class _Progress:
    """One vLLM request of a session, as its outputs arrive."""

    request: str
    prompt_tokens: int
    #: leading prompt tokens that must come from cache (placeholders of a resume)
    need: int
    started: float
    finished: asyncio.Future[None]
    first: bool = True
    cached: int = 0
    last: float = 0.0
    announced: int = 0


def _envelope(hints: KvHints | None) -> KvHintsEnvelope | None:
    """Our envelope as vLLM carries it on a request (the same fields)."""
    if hints is None:
        return None
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    actions = [KvHintAction(**a.model_dump()) for a in hints.actions]
    return KvHintsEnvelope(hints.protocol_version, hints.message_id, actions)


def _sampling(session: Session, remaining: int, kvsp: dict[str, Any]) -> SamplingParams:
    """vLLM's parameters for the session's next request: greedy, or kvsp's sampling rule from
    the session's next output step on (``KvspSampling``), so that a resume draws what the
    failed instance would have."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from kvsp.integrations.vllm.sampling import sampling_args

    sampler: Sampler = session.sampler
    extra: dict[str, Any] = {"kv_transfer_params": {"kvsp": kvsp}}
    if sampler.method != "greedy":
        extra.update(sampling_args(sampler, len(session.generated)))
    return SamplingParams(
        max_tokens=remaining,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
        temperature=0.0,
    )


class VllmInstanceService(InstanceService):
    sharded_caches = False
    engine_pages = True

    def __init__(
        self, config: InstanceConfig, options: VllmOptions, files: ModelFiles | None = None
    ) -> None:
        self.options = options
        super().__init__(config, files)
        model = self.files.bounds
        self.bounds = ModelBounds(
            min(model.context_tokens, options.context_tokens), model.vocab_size
        )

    def _start_engine(self) -> tuple[int, TierData] | None:
        """vLLM's engine with ``KVSPConnector``; the embedded store keeps only G2 (vLLM's
        pages are its G1, which the store does not see)."""
        vllm_environment(self.options.kv_cache_gib)
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        config = self.config
        transfer = None
        if config.index_url is not None:
            extra = {
                "index_url": config.index_url,
                "holder_url": self.url,
                "copy_urls": [] if config.offload_url is None else [config.offload_url],
                "tenants_file": str(self.options.tenants_file),
                "request_tenants": True,
                "model_dir": str(self.files.folder),
                "block_tokens": self.block_tokens,
                "local_reads": self.options.local_reads,
            }
            if config.token is not None:
                extra["token"] = config.token
            transfer = KVTransferConfig(
                kv_connector="KVSPConnector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            )
        # vLLM's KV events, on a socket only this process can reach: what its pages hold
        self._events_dir = tempfile.TemporaryDirectory(prefix="kvsp-vllm-")
        events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"ipc://{self._events_dir.name}/kv-events",
        )
        from kvsp.integrations.vllm.sampling import KvspSampling

        args = EngineArgs(
            model=str(self.files.weights),
            logits_processors=[KvspSampling],
            kv_events_config=events if transfer is not None else None,
            dtype="float32",
            block_size=self.options.page_tokens,
            max_model_len=self.options.context_tokens,
            num_gpu_blocks_override=self.options.pages,
            enforce_eager=True,
            enable_prefix_caching=True,
            kv_transfer_config=transfer,
            distributed_executor_backend="uni",
            seed=0,
        )
        self.vllm = LLMEngine.from_engine_args(args)
        self.driver = _Driver(self.vllm)
        return None

    @functools.cached_property
    def engine_identity(self) -> str:
        """vLLM's build, its torch and device, and how the engine was configured (page size,
        element type, eager mode): what decides its output bits."""
        import torch
        import vllm

        from kvsp import __version__

        return (
            f"kvsp {__version__}; vllm {vllm.__version__}; torch {torch.__version__}; "
            f"cpu float32 eager; pages {self.options.page_tokens}"
        )

    def _connector(self) -> KVSPConnector | None:
        """The scheduler's ``KVSPConnector`` (None without an index: no KVSP)."""
        try:
            return self.vllm.engine_core.engine_core.scheduler.connector  # type: ignore[attr-defined, no-any-return]
        except AttributeError:
            return None

    async def start(self) -> None:
        await super().start()
        local_holders.register(self.holder)  # the connector reads it without HTTP
        connector = self._connector()
        if connector is not None:  # vLLM's pages in the session index, from its KV events
            loop = asyncio.get_running_loop()

            def changed(changes: list[tuple[BlockId, bool]]) -> None:
                loop.call_soon_threadsafe(self.kv.engine_changed, changes)

            connector.g1.watch(changed)

    def engine_load(self) -> tuple[int, int]:
        """vLLM's scheduler: requests waiting for room, and the batch it runs."""
        try:
            scheduler = self.vllm.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
            return len(scheduler.waiting), len(scheduler.running)
        except AttributeError:
            return super().engine_load()

    def kv_utilization(self) -> float:
        """The share of vLLM's KV pages in use."""
        try:
            usage = self.vllm.engine_core.engine_core.scheduler.kv_cache_manager.usage  # type: ignore[attr-defined]
        except AttributeError:
            return 0.0
        return float(usage)

    async def close(self) -> None:
        self.driver.stop()
        with contextlib.suppress(Exception):
            self.vllm.engine_core.shutdown()  # the connector's saves in flight finish first
        self._events_dir.cleanup()
        local_holders.unregister(self.holder)
        await super().close()

    # -- generation ----------------------------------------------------------------------------

    async def _begin(self, session: Session, tokens: Sequence[int]) -> None:
        self._admit(session)
        kvsp = {"tenant": session.tenant.name}
        params = _sampling(session, session.max_tokens, kvsp)
        salt = session.tenant.scope_id
        self._spawn(self._generate(session, list(tokens), params, salt, 0))

    async def _begin_resume(self, session: Session, start: int, known: Sequence[int]) -> None:
        b = self.block_tokens
        prefix = session.prompt_blocks
        try:  # verified copies here first, so vLLM's loads cannot fail over the network
            # vLLM reads them from the holder, nothing is imported here
            loaded = await self.reuse.load(session, prefix[:start], lambda _index, _block: None)
            if loaded < start:
                raise NotFound("the checkpoint's prompt blocks are not held anywhere reachable")
        except BaseException:
            await self.reuse.release(session)
            raise
        session.cached = {}
        self._admit(session)
        session.max_tokens = max(session.max_tokens, len(session.generated))
        remaining = session.max_tokens - len(session.generated)
        if remaining <= 0:
            self._spawn(self._finish(session))
            return
        prompt = [_PLACEHOLDER] * (start * b) + list(known)
        params = _sampling(
            session, remaining, {"tenant": session.tenant.name, "prefix_keys": list(prefix)}
        )
        salt = f"{session.tenant.scope_id}:{prefix[-1] if prefix else 'root'}"
        self._spawn(self._generate(session, prompt, params, salt, start * b))

    async def _generate(
        self,
        session: Session,
        prompt: list[int],
        params: SamplingParams,
        salt: str,
        need: int,
    ) -> None:
        from vllm.inputs import TokensPrompt

        loop = asyncio.get_running_loop()
        progress = _Progress(
            f"{session.session}:{uuid.uuid4().hex[:12]}",
            len(prompt),
            need,
            time.perf_counter(),
            loop.create_future(),
        )

        def handler(output: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(self._on_output, session, progress, output)

        self.driver.add(
            progress.request,
            TokensPrompt(prompt_token_ids=prompt, cache_salt=salt),
            params,
            handler,
            session.session,
            _envelope(None if session.hints is None else session.hints[1]),
        )
        try:
            await progress.finished
        except Exception as exc:  # the session ends with the error; the service goes on
            log.warning("session %s failed: %r", session.session, exc)
            session.error = repr(exc)
        await self._finish(session)

    def _on_output(
        self, session: Session, progress: _Progress, output: RequestOutput | BaseException
    ) -> None:
        if progress.finished.done():
            return
        if session.cancelled is not None:  # moved elsewhere, or its client went away
            self.driver.abort(progress.request)
            progress.finished.set_result(None)
            return
        if isinstance(output, BaseException):
            progress.finished.set_exception(output)
            return
        now = time.perf_counter()
        if progress.first:
            progress.first = False
            progress.cached = output.num_cached_tokens or 0
            if progress.cached < progress.need:
                self.driver.abort(progress.request)
                progress.finished.set_exception(
                    NotFound(f"vLLM loaded {progress.cached} of the {progress.need} prefix tokens")
                )
                return
            computed = progress.prompt_tokens - progress.cached
            if computed > 1:
                self.rates.prefill = computed / max(now - progress.started, 1e-6)
        else:
            tokens = len(output.outputs[0].token_ids) if output.outputs else 0
            if tokens:
                self.rates.decode = tokens / max(now - progress.last, 1e-6)
        progress.last = now
        for token in output.outputs[0].token_ids if output.outputs else ():
            self._on_token(session, token)
        self._announce(session, progress)
        if output.finished:
            transfer = output.kv_transfer_params or {}
            loaded = int(transfer.get("kvsp", {}).get("loaded_tokens", 0))
            cached = {"g1": progress.cached - loaded, "remote": loaded}
            session.cached = {where: n for where, n in cached.items() if n > 0}
            progress.finished.set_result(None)

    def _announce(self, session: Session, progress: _Progress) -> None:
        """Tell the session index about the session's blocks as their tokens complete, and
        checkpoint when one did."""
        count = len(session.prompt_blocks) + len(session.chain.keys)
        for i in range(progress.announced, count):
            block = session.block_of(self.compat_id, i)
            if block is not None:  # each block in its scope: a shared prefix's, or the tenant's
                parent = session.block_of(self.compat_id, i - 1) if i else None
                tokens = session.tokens_of(i, self.block_tokens)
                self.kv.completed(session.session, block, parent, tokens)
        if count > progress.announced and session.gate.on_block():
            self._spawn(self._checkpoint(session))  # KVSP 6.8: at every completed block
        progress.announced = count
