"""The OpenAI-compatible front end, served beside the controller (``--frontend``): completions
and chat completions, placed by the controller, streamed from the chosen instance, and carried
across an instance failure.

- **Who.** The API key (``Authorization: Bearer``) names the tenant (its SHA-256 is listed in the
  tenants file); the tenant's scope keys its blocks, so one tenant never reuses another's cache.
- **What.** ``prompt`` (text or token ids) or ``messages`` (rendered with the model's chat
  template) become tokens; ``temperature`` 0 is greedy, otherwise temperature or top-p sampling
  with a ``seed`` (chosen when absent), whose draws depend only on (seed, step).
- **Where.** The controller places the request (cost model, prefetch where it pays) and the
  front end streams ``POST generate`` from the chosen instance. The controller is the one of
  this process, or the leader among several (``frontend.controllers``): a stream comes from
  the instance, so a controller that dies never cuts it.
- **Failover.** If the stream breaks, the front end waits until the controller has resumed the
  session elsewhere (a higher epoch), then reads ``GET sessions/{s}/tokens?from=i`` there: every
  index is delivered once, tokens of a lower epoch or an index already delivered are discarded
  (counted), so the client sees nothing repeated or altered. If it cannot go on, the stream
  ends with an error event naming the session and the next index, then ``[DONE]``.
- **Answer.** Server-sent events in OpenAI's chunk format (``data: {...}`` then ``data:
  [DONE]``) or one JSON object; ``usage`` with ``prompt_tokens_details.cached_tokens``; a
  ``kvsp`` member with the session, the epochs seen, the indexes, and what was discarded.
- **Sessions.** ``session`` (or ``X-Session-Id``) keeps a conversation on one session: the turn's
  end goes to the hint policy (``tool_call``/``expected_gap_ms`` extension members say it ends in
  a tool call). A request without one gets a session of its own, forgotten when it is done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol, TypeVar, cast

import httpx
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kvsp.core.problems import InvalidInput, KvspError, ServiceUnavailable, Unauthenticated
from kvsp.core.records import Sampler, SessionName
from kvsp.core.urls import canonical_url
from kvsp.frontend.controllers import Controller, Placed
from kvsp.frontend.metrics import FrontEndMetrics
from kvsp.model import SERVED_MODEL_NAME, ModelBounds, ModelFiles
from kvsp.tasks import Background
from kvsp.tenants import Tenant, Tenants
from kvsp.web.client import KEEPALIVE_EXPIRY_S, auth_headers, carry_request_ids

__all__ = ["CompletionRequest", "FrontEnd", "Tokenizer", "Turn", "load_frontend"]

log = logging.getLogger("kvsp.frontend")

T = TypeVar("T")

_SESSION_NAME: TypeAdapter[str] = TypeAdapter(SessionName)
#: how long a broken stream waits for its session to be resumed elsewhere
RESUME_WAIT_S = 30.0


class SessionMoved(Exception):
    """The instance stopped the session: the controller resumed it elsewhere."""


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=1 << 20)]


class CompletionRequest(BaseModel):
    """The members we read of an OpenAI request (others are ignored), and our extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: (
        Annotated[str, Field(max_length=1 << 20)]
        | Annotated[list[int], Field(max_length=1 << 20)]
        | None
    ) = None
    messages: Annotated[list[Message], Field(min_length=1, max_length=1024)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=4096)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    seed: Annotated[int, Field(ge=0, le=(1 << 63) - 1)] | None = None
    stream: bool = False
    #: extensions: the conversation this turn belongs to (``session``, ``session_id`` or the
    #: ``X-Session-ID`` header: any name, namespaced by the tenant), and how the turn ends
    session: SessionName | None = None
    session_id: SessionName | None = None
    tool_call: bool = False
    expected_gap_ms: Annotated[int, Field(ge=0, le=86_400_000)] | None = None

    def sampler(self) -> Sampler:
        if self.temperature == 0:
            return Sampler(method="greedy", deterministic=True)
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        if self.top_p < 1:
            params = {"p": self.top_p, "temperature": self.temperature}
            return Sampler(method="top-p", params=params, seed=seed)
        return Sampler(method="temperature", params={"temperature": self.temperature}, seed=seed)


@dataclass
class Turn:
    """What one request delivered, and how."""

    session: str
    instance: str
    prompt_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    #: tokens thrown away: a lower epoch, or an index delivered already
    discarded: int = 0
    duplicates: int = 0
    resumed: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    finish_reason: str = "length"

    def summary(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "instance": self.instance,
            "epochs": sorted(set(self.epochs)),
            "indexes": len(self.tokens),
            "discarded_stale_epoch": self.discarded,
            "discarded_duplicates": self.duplicates,
            "resumed": self.resumed,
            "cached_tokens": self.cached_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
        }


class FrontEnd:
    def __init__(
        self,
        controller: Controller,
        tenants: Tenants,
        tokenizer: Tokenizer,
        compat_id: str,
        model: str,
        stop_ids: frozenset[int],
        bounds: ModelBounds,
        instance_token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        metrics: FrontEndMetrics | None = None,
    ) -> None:
        self.controller = controller
        self.metrics = metrics or FrontEndMetrics()
        self.tenants = tenants
        #: calls to the controller that nobody waits for (a client that went away)
        self._later = Background(log, logging.INFO)
        self.tokenizer = tokenizer
        self.bounds = bounds
        #: tokenizing runs here, one request at a time, never on the event loop (a 2 MiB chat
        #: body took 2.2 s); one thread, since a tokenizer is not shared across threads
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="kvsp-tokenize")
        self.compat_id = compat_id
        self.model = model
        self.stop_ids = stop_ids
        self.http = httpx.AsyncClient(
            headers=auth_headers(instance_token),
            timeout=httpx.Timeout(30.0, read=120.0),
            transport=transport,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
            event_hooks={"request": [carry_request_ids]},
        )

    async def aclose(self) -> None:
        await self._later.drain()
        await self.http.aclose()
        await self.controller.aclose()
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    # -- who and what --------------------------------------------------------------------------

    def tenant(self, authorization: str | None) -> Tenant:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("expected 'Authorization: Bearer <API key>'")
        found = self.tenants.by_api_key(key.strip())
        if found is None:
            raise Unauthenticated("unknown API key")
        return found

    def parse(self, body: bytes, chat: bool, session: str | None = None) -> CompletionRequest:
        """The request; ``session`` (the ``X-Session-Id`` header) when the body names none."""
        try:
            request = CompletionRequest.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise InvalidInput(f"{where}: {first['msg']}") from None
        if chat and request.messages is None:
            raise InvalidInput("messages: a chat completion needs messages")
        if not chat and request.prompt is None:
            raise InvalidInput("prompt: a completion needs a prompt")
        named = [n for n in (request.session, request.session_id, session) if n is not None]
        if len(set(named)) > 1:
            raise InvalidInput("session, session_id and X-Session-ID name different sessions")
        if session is not None:
            try:
                _SESSION_NAME.validate_python(session)
            except ValidationError:
                raise InvalidInput(
                    "X-Session-ID: must be 1 to 128 visible ASCII characters"
                ) from None
        request.session = named[0] if named else None
        return request

    async def prompt(self, request: CompletionRequest, max_tokens: int) -> list[int]:
        """The prompt's tokens (tokenized off the event loop), checked against the model's
        context and vocabulary before anything is placed."""
        if isinstance(request.prompt, list):
            tokens = self.tokens(request)
        else:
            loop = asyncio.get_running_loop()
            tokens = await loop.run_in_executor(self._tokenizing, self.tokens, request)
        self.bounds.check(tokens, max_tokens)
        return tokens

    def tokens(self, request: CompletionRequest) -> list[int]:
        if request.messages is not None:
            conversation = [m.model_dump() for m in request.messages]
            text = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer.encode(str(text), add_special_tokens=False)
        if isinstance(request.prompt, list):
            if not request.prompt or any(not 0 <= t < 1 << 31 for t in request.prompt):
                raise InvalidInput("prompt: token ids must be non-negative 32-bit integers")
            return list(request.prompt)
        ids = self.tokenizer.encode(request.prompt or "", add_special_tokens=False)
        if not ids:
            raise InvalidInput("prompt: it has no tokens")
        return ids

    # -- placing and streaming -----------------------------------------------------------------

    async def run(
        self, tenant: Tenant, request: CompletionRequest
    ) -> tuple[Turn, AsyncGenerator[int, None]]:
        """Place the request; the turn's record and its tokens, in index order, once each."""
        started = time.perf_counter()
        max_tokens = request.max_completion_tokens or request.max_tokens or 16
        tokens = await self.prompt(request, max_tokens)
        sampler = request.sampler()
        placement = await self.controller.place(
            tenant, self.compat_id, tokens, request.session or str(uuid.uuid4()), sampler,
            max_tokens,
        )  # fmt: skip
        if placement.instance is None:
            raise ServiceUnavailable(f"no instance can take the request: {placement.reason}")
        turn = Turn(placement.session, canonical_url(placement.instance), len(tokens))
        served = placement.sampler or sampler  # deterministic only where failover keeps it so
        body = {
            "tenant": tenant.name, "tokens": tokens, "sampler": served.to_json(),
            "max_tokens": max_tokens, "session": placement.session, "epoch": placement.epoch,
        }  # fmt: skip
        stream = self._stream(turn, body, placement, started, tenant, request)
        return turn, stream

    async def _stream(
        self,
        turn: Turn,
        body: dict[str, Any],
        placement: Placed,
        started: float,
        tenant: Tenant,
        request: CompletionRequest,
    ) -> AsyncGenerator[int, None]:
        epoch = int(body["epoch"])
        first = True
        abandoned = False
        finish = "error"
        last_token_at = started
        try:
            while True:
                if first:
                    call = self.http.stream("POST", turn.instance + "generate", json=body)
                else:
                    path = f"sessions/{turn.session}/tokens?from={len(turn.tokens)}"
                    call = self.http.stream("GET", turn.instance + path)
                try:
                    async with call as response:
                        if response.status_code != 200:
                            await response.aread()
                            raise ServiceUnavailable(
                                f"{turn.instance} answered {response.status_code}: "
                                f"{response.text[:200]}"
                            )
                        async for line in response.aiter_lines():
                            doc = json.loads(line)
                            if "done" in doc:
                                if doc.get("moved"):
                                    raise SessionMoved(f"{turn.instance} stopped it")
                                if doc.get("error"):
                                    raise ServiceUnavailable(f"generation failed: {doc['error']}")
                                if first:
                                    turn.cached_tokens = int(doc.get("cached_tokens", 0))
                                finish = turn.finish_reason
                                return
                            if doc["epoch"] < epoch:
                                turn.discarded += 1
                                continue
                            epoch = doc["epoch"]
                            if doc["index"] != len(turn.tokens):
                                turn.duplicates += doc["index"] < len(turn.tokens)
                                continue
                            turn.tokens.append(doc["token"])
                            turn.epochs.append(epoch)
                            now = time.perf_counter()
                            if turn.ttft_s is None:
                                turn.ttft_s = now - started
                                self.metrics.ttft.labels(tenant.name).observe(turn.ttft_s)
                                self._report_ttft(tenant, placement, turn.ttft_s)
                            else:
                                self.metrics.itl.labels(tenant.name).observe(now - last_token_at)
                            last_token_at = now
                            if doc["token"] in self.stop_ids:
                                turn.finish_reason = "stop"
                            yield doc["token"]
                except (httpx.TransportError, json.JSONDecodeError, SessionMoved) as exc:
                    log.warning("stream of %s from %s broke: %s", turn.session, turn.instance, exc)
                    epoch, turn.instance = await self._moved(tenant, turn.session, epoch)
                    turn.resumed += 1
                    first = False
        except (GeneratorExit, asyncio.CancelledError):
            abandoned = True  # the client went away: the instance stops generating
            finish = "abandoned"
            raise
        finally:
            self.metrics.turn(tenant.name, turn.prompt_tokens, turn.cached_tokens,
                              len(turn.tokens), finish)  # fmt: skip
            if not abandoned:
                await self._turn_done(tenant, turn, request)
            elif request.session is None:
                self._call_later(self.controller.forget(tenant, turn.session), turn.session)
            else:
                self._call_later(self.controller.abandon(tenant, turn.session), turn.session)

    def _call_later(self, work: Coroutine[Any, Any, None], session: str) -> None:
        """Tell the controller without waiting (the client went away: nobody waits)."""
        self._later.run(work, f"session {session}")

    async def _moved(self, tenant: Tenant, session: str, epoch: int) -> tuple[int, str]:
        """Wait until the controller resumed ``session`` with a higher epoch; where."""
        deadline = time.monotonic() + RESUME_WAIT_S
        while time.monotonic() < deadline:
            try:
                where = await self.controller.where(tenant, session)
            except KvspError:
                where = None  # no controller leads for a moment
            if where is not None and where[0] > epoch:
                return where[0], canonical_url(where[1])
            await asyncio.sleep(0.05)
        raise ServiceUnavailable(f"session {session} was not resumed within {RESUME_WAIT_S} s")

    def _report_ttft(self, tenant: Tenant, placement: Placed, ttft_s: float) -> None:
        self._call_later(
            self.controller.report_ttft(tenant, placement.decision, ttft_s * 1e6),
            placement.session,
        )

    async def _turn_done(self, tenant: Tenant, turn: Turn, request: CompletionRequest) -> None:
        """The conversation goes on (the hint policy hears of the turn's end), or the request's
        own session is forgotten."""
        try:
            if request.session is None:
                await self.controller.forget(tenant, turn.session)
            else:
                await self.controller.turn_ended(
                    tenant, turn.session, request.tool_call, request.expected_gap_ms
                )
        except KvspError as exc:
            log.info("end of turn of %s: %s", turn.session, exc.detail)

    # -- OpenAI answers ------------------------------------------------------------------------

    async def answer(
        self, tenant: Tenant, request: CompletionRequest, chat: bool
    ) -> dict[str, Any]:
        turn, tokens = await self.run(tenant, request)
        ids = [t async for t in tokens]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        choice: dict[str, Any] = {"index": 0, "finish_reason": turn.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{turn.session}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(turn),
            "kvsp": {**turn.summary(), "token_ids": ids},
        }

    async def events(
        self, tenant: Tenant, request: CompletionRequest, chat: bool
    ) -> AsyncIterator[bytes]:
        """The answer as server-sent events, one chunk per token (text decoded so far, held
        back while a multi-byte character is incomplete)."""
        turn, tokens = await self.run(tenant, request)
        name = f"{'chatcmpl' if chat else 'cmpl'}-{turn.session}"
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())

        def chunk(delta: str, finish: str | None, extra: dict[str, Any]) -> bytes:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"role": "assistant", "content": delta} if delta else {}
            else:
                choice["text"] = delta
            doc = {"id": name, "object": kind, "created": created, "model": self.model,
                   "choices": [choice], **extra}  # fmt: skip
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        async def out() -> AsyncIterator[bytes]:
            try:
                async for piece in pieces():
                    yield piece
            finally:  # also when the client went away: the instance then stops
                await tokens.aclose()

        async def pieces() -> AsyncIterator[bytes]:
            ids: list[int] = []
            sent = ""
            try:
                async for token in tokens:
                    ids.append(token)
                    text = self.tokenizer.decode(ids, skip_special_tokens=True)
                    if text.endswith("\ufffd"):
                        continue
                    delta, sent = text[len(sent) :], text
                    index = {"index": len(ids) - 1, "epoch": turn.epochs[-1], "token": token}
                    yield chunk(delta, None, {"kvsp": index})
            except KvspError as exc:  # the client can resume: the session, from this index
                error = {"error": {"message": exc.detail, "type": exc.slug},
                         "kvsp": {"session": turn.session, "next_index": len(ids)}}  # fmt: skip
                yield b"data: " + json.dumps(error).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
                return
            final = {"usage": self._usage(turn), "kvsp": turn.summary()}
            yield chunk("", turn.finish_reason, final)
            yield b"data: [DONE]\n\n"

        return out()

    @staticmethod
    def _usage(turn: Turn) -> dict[str, Any]:
        return {
            "prompt_tokens": turn.prompt_tokens,
            "completion_tokens": len(turn.tokens),
            "total_tokens": turn.prompt_tokens + len(turn.tokens),
            "prompt_tokens_details": {"cached_tokens": turn.cached_tokens},
        }


def load_frontend(
    controller: Controller,
    tenants: Tenants,
    files: ModelFiles,
    instance_token: str | None = None,
    metrics: FrontEndMetrics | None = None,
) -> FrontEnd:
    """A front end for the installed model: its tokenizer and chat template, its
    Compatibility ID, its end-of-sequence tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(files.weights)
    eos = tokenizer.eos_token_id
    stop = frozenset([eos] if isinstance(eos, int) else (eos or []))
    return FrontEnd(
        controller,
        tenants,
        cast(Tokenizer, tokenizer),  # HF's signatures are wider than what we call
        files.compat_id.hex(),
        SERVED_MODEL_NAME,
        stop,
        files.bounds,
        instance_token,
        metrics=metrics,
    )
