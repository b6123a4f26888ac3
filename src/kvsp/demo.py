"""``kvsp demo``: a cluster on this machine (``kvsp up``) and a scripted workload that shows what
kvsp does, each claim checked; the exit status is 0 only if every check held.

1. Multi-turn chat sessions share a long system prompt: the first request computes it (cold),
   later turns reuse it and their own history on the same instance (warm local), and one turn is
   placed on the other instance while the first drains: its prefix is fetched through the Index
   Service (warm remote). Every answer is compared with the same request computed from scratch.
2. A session pauses for a tool call: the front end tells the controller, whose policy pins the
   session's KV on its instance; the continuation reuses all of it.
3. An instance is killed mid-generation: the stream continues from the other instance; every
   index is delivered once, stale or repeated tokens are discarded, and the output equals the
   uninterrupted reference.
4. Two tenants share the long system prompt (a shared scope, KVSP 4.2): the second tenant's
   first request on a new question reuses exactly the system prompt's blocks, and nothing of
   the first tenant's own conversation, which the first tenant does reuse.

The references of every check are computed by the second tenant: its answers can reuse only the
shared system prompt of the first tenant's cache.
"""

from __future__ import annotations

import json
import signal
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvsp.core.ids import tenant_session
from kvsp.local import TENANTS, LocalCluster
from kvsp.model import installed, system_prefix

__all__ = ["run_demo"]

SYSTEM = (
    "You are the support assistant of a company that runs a fleet of electric delivery vans "
    "across three cities. Answer briefly and precisely. Vans are charged overnight at the "
    "depot; a full charge gives about 250 kilometres. Drivers report faults through the app, "
    "and a mechanic calls them back within two hours. Deliveries before 8 am are not allowed "
    "in the old town. Parcels over 30 kilograms need two people. Customers may reschedule a "
    "delivery until 6 pm the day before. Refunds are handled by the billing team, never by "
    "drivers. In snow, vans keep to main roads and the dispatcher may cancel routes. Every "
    "answer must name the team that can help if the question is not about deliveries. The "
    "depot opens at 5 am and closes at 11 pm; the night guard can let drivers in after hours. "
    "Drivers get a thirty minute break every four hours. The app shows every route's stops, "
    "the customer's notes and the parcel sizes. Damaged parcels are photographed and returned."
)
QUESTIONS = [
    ["Can I deliver in the old town at 7 am?", "And at 9 am?", "What if it snows?"],
    ["How far can a van go on a charge?", "Where do I charge it?", "What if it breaks down?"],
    ["A parcel weighs 40 kg. What now?", "Who handles refunds?", "Can the customer reschedule?"],
]
MAX_TOKENS = 24


@dataclass
class Answer:
    tokens: list[int]
    text: str
    ttft_s: float
    cached: int
    prompt_tokens: int
    summary: dict[str, Any]
    indexes: list[int] = field(default_factory=list)


@dataclass
class Check:
    what: str
    figure: str
    held: bool


class Demo:
    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        info = cluster.describe()
        self.base = str(info["openai_base_url"]) + "/"
        self.controller = cluster.controller.url
        self.auth = {"authorization": f"Bearer {info['api_key']}"}
        self.other = {"authorization": f"Bearer {cluster.api_keys['other']}"}
        self.operator = {"authorization": f"Bearer {cluster.operator_token}"}
        self.http = httpx.Client(timeout=httpx.Timeout(60.0, read=180.0))
        self.checks: list[Check] = []

    def session_view(self, name: str) -> dict[str, Any]:
        """What the controller knows of the first tenant's session ``name`` (it keeps it under
        the UUID ``tenant_session`` gives)."""
        placed = tenant_session(self.cluster.scope_ids[TENANTS[0]], name)
        view: dict[str, Any] = self.http.get(
            self.controller + f"sessions/{placed}", headers=self.operator
        ).json()
        return view

    def chat(
        self,
        messages: list[dict[str, str]],
        session: str | None = None,
        on_token: Callable[[int], None] | None = None,
        **extra: Any,
    ) -> Answer:
        body: dict[str, Any] = {"messages": messages, "max_tokens": MAX_TOKENS,
                                "temperature": 0, "stream": True, **extra}  # fmt: skip
        if session is not None:
            body["session"] = session
        start = time.perf_counter()
        ttft = 0.0
        tokens: list[int] = []
        indexes: list[int] = []
        text = ""
        final: dict[str, Any] = {}
        with self.http.stream("POST", self.base + "chat/completions", json=body,
                              headers=self.auth) as response:  # fmt: skip
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    raise RuntimeError(doc["error"]["message"])
                if "usage" in doc:
                    final = doc
                    continue
                if not tokens:
                    ttft = time.perf_counter() - start
                tokens.append(doc["kvsp"]["token"])
                indexes.append(doc["kvsp"]["index"])
                text += doc["choices"][0]["delta"].get("content", "")
                if on_token is not None:
                    on_token(len(tokens))
        usage = final["usage"]
        return Answer(
            tokens, text, ttft, usage["prompt_tokens_details"]["cached_tokens"],
            usage["prompt_tokens"], final["kvsp"], indexes,
        )  # fmt: skip

    def reference(self, messages: list[dict[str, str]]) -> list[int]:
        """The same request from another tenant, on a session of its own: nothing of the
        first tenant's cache but the shared system prompt can reach it."""
        return self.ask(messages, self.other)[0]

    def ask(self, messages: list[dict[str, str]], key: dict[str, str]) -> tuple[list[int], int]:
        """A request, not streamed, with an API key: its tokens, and its cached prompt tokens."""
        body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = self.http.post(self.base + "chat/completions", json=body, headers=key)
        answer.raise_for_status()
        doc = answer.json()
        tokens: list[int] = doc["kvsp"]["token_ids"]
        return tokens, int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])

    def set_state(self, instance: str, state: str) -> None:
        body = {"instance": instance, "state": state}
        self.http.put(self.controller + "instances/state", json=body, headers=self.operator)
        if state == "active":
            self.cluster.wait_active(len(self.cluster.instance_processes))

    def check(self, what: str, figure: str, held: bool) -> None:
        self.checks.append(Check(what, figure, held))


def run_demo(folder: Path, console: Console | None = None) -> bool:
    """Run the whole demo; True if every check held."""
    console = console or Console()
    cluster = LocalCluster(
        folder, instances=2, g1_blocks=64, g2_bytes="128M", status_ttl_ms=1500,
        shared_system=SYSTEM,
    )  # fmt: skip
    with Progress(console=console) as progress:
        task = progress.add_task("starting the cluster", total=None)
        cluster.start()
        progress.update(task, total=1, completed=1, description="cluster up")
    demo = Demo(cluster)
    try:
        _sessions(demo, console)
        _tool_gap(demo, console)
        _failover(demo, console)
        _shared_prefix(demo, console)
    finally:
        demo.http.close()
        cluster.stop()
    table = Table(title="kvsp demo")
    table.add_column("check")
    table.add_column("figure", justify="right")
    table.add_column("held", justify="center")
    for c in demo.checks:
        table.add_row(c.what, c.figure, "yes" if c.held else "NO")
    console.print(table)
    ok = all(c.held for c in demo.checks)
    console.print("every check held" if ok else "some checks did not hold", style="bold")
    return ok


def _sessions(demo: Demo, console: Console) -> None:
    sessions = [str(uuid.uuid4()) for _ in QUESTIONS]
    history: list[list[dict[str, str]]] = [
        [{"role": "system", "content": SYSTEM}] for _ in QUESTIONS
    ]
    cold: float | None = None
    local: list[float] = []
    remote: Answer | None = None
    continuation_cached = continuation_prompt = 0
    same = True
    served: set[str] = set()
    turns = len(QUESTIONS[0])
    with Progress(console=console) as progress:
        task = progress.add_task("multi-turn sessions", total=turns * len(QUESTIONS))
        for turn in range(turns):
            for n, questions in enumerate(QUESTIONS):
                messages = [*history[n], {"role": "user", "content": questions[turn]}]
                drained = None
                if n == 1 and turn == 1:  # its prefix lives on one instance: drain it
                    where = demo.session_view(sessions[n])["instance"]
                    demo.set_state(where, "draining")
                    drained = where
                answer = demo.chat(messages, sessions[n])
                if drained is not None:
                    demo.set_state(drained, "active")
                    remote = answer
                same = same and answer.tokens == demo.reference(messages)
                served.add(str(answer.summary["instance"]))
                if cold is None:
                    cold = answer.ttft_s
                elif turn > 0 and drained is None:
                    local.append(answer.ttft_s)
                if turn > 0:
                    continuation_cached += answer.cached
                    continuation_prompt += answer.prompt_tokens
                history[n] = [*messages, {"role": "assistant", "content": answer.text}]
                progress.advance(task)
    if cold is None or remote is None:
        raise RuntimeError("the workload ran no turn")
    warm = statistics.mean(local)
    demo.check("instances that served the sessions", f"{len(served)}", len(served) == 2)
    demo.check("TTFT cold (first request)", f"{cold * 1000:.0f} ms", True)
    demo.check("TTFT warm local (mean of continuations)", f"{warm * 1000:.0f} ms", warm < cold)
    demo.check(
        "TTFT warm remote (prefix from the other instance)",
        f"{remote.ttft_s * 1000:.0f} ms, {remote.cached} tokens reused",
        remote.cached > 0 and remote.ttft_s < cold,
    )
    rate = continuation_cached / continuation_prompt
    demo.check("cached prompt tokens of continuations", f"{continuation_cached}", True)
    demo.check("hit rate of continuations", f"{rate:.1%}", rate >= 0.8)
    demo.check(
        "every answer equals another tenant's (only the system prompt shared)",
        "yes" if same else "no",
        same,
    )


def _tool_gap(demo: Demo, console: Console) -> None:
    session = str(uuid.uuid4())
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Look up today's route for van 12."}]  # fmt: skip
    with Progress(console=console) as progress:
        task = progress.add_task("a session with a tool gap", total=2)
        first = demo.chat(messages, session, tool_call=True, expected_gap_ms=20_000)
        progress.advance(task)
        outcomes = demo.session_view(session).get("hints", {}).get("outcomes", {})
        tool = [*messages, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "The tool says: 14 stops, depot at 6 am."}]  # fmt: skip
        second = demo.chat(tool, session)
        progress.advance(task)
    # the first prompt is a prefix of the second one: all its whole blocks must be reused
    whole = first.prompt_tokens // 16 * 16
    demo.check(
        "tool gap: the controller pinned the session's KV",
        ", ".join(f"{k} {v}" for k, v in outcomes.items()) or "no hint",
        outcomes.get("kv.pin:accepted", 0) == 1,
    )
    demo.check(
        "tool gap: the continuation reused the conversation",
        f"{second.cached} of {second.prompt_tokens} prompt tokens",
        second.cached >= whole,
    )


def _failover(demo: Demo, console: Console) -> None:
    question = "Write the checklist a driver follows at the depot."
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    expected = demo.reference(messages)
    session = str(uuid.uuid4())
    killed: list[str] = []

    def kill_at(count: int) -> None:
        if count == 8 and not killed:
            where = demo.session_view(session)["instance"]
            victim = next(p for p in demo.cluster.instance_processes if p.url == where)
            if victim.popen is not None:
                victim.popen.send_signal(signal.SIGKILL)
                killed.append(where)

    with Progress(console=console) as progress:
        task = progress.add_task("an instance killed mid-generation", total=MAX_TOKENS)

        def on_token(count: int) -> None:
            progress.update(task, completed=count)
            kill_at(count)

        answer = demo.chat(messages, session, on_token=on_token)
    summary = answer.summary
    once = answer.indexes == list(range(len(expected)))
    demo.check(
        "failover: indexes delivered once each",
        f"{len(answer.indexes)} of {len(expected)}, epochs {summary['epochs']}",
        once and bool(killed) and summary["resumed"] == 1,
    )
    demo.check(
        "failover: stale or repeated tokens discarded",
        f"{summary['discarded_stale_epoch']} stale, {summary['discarded_duplicates']} repeated",
        True,
    )
    demo.check(
        "failover: output equals the uninterrupted reference",
        "yes" if answer.tokens == expected else "no",
        answer.tokens == expected,
    )


def _shared_prefix(demo: Demo, console: Console) -> None:
    question = "Which stop comes first when two deliveries share a street?"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    shared = len(system_prefix(installed())(SYSTEM)) // 16 * 16  # its whole blocks
    with Progress(console=console) as progress:
        task = progress.add_task("two tenants share the system prompt", total=3)
        first, _ = demo.ask(messages, demo.auth)
        progress.advance(task)
        time.sleep(1.0)  # its blocks reach the Index Service (for an instance that lacks them)
        theirs, other_cached = demo.ask(messages, demo.other)
        progress.advance(task)
        again, own_cached = demo.ask(messages, demo.auth)
        progress.advance(task)
    demo.check(
        "shared system prompt: the other tenant's first request reuses exactly its blocks",
        f"{other_cached} of {shared} tokens",
        other_cached == shared > 0,
    )
    demo.check(
        "shared system prompt: nothing of the first tenant's own conversation is shared",
        f"first tenant again {own_cached}, other tenant {other_cached}",
        own_cached > other_cached and theirs == first == again,
    )
