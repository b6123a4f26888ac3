"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo 1.6.1), a
consumer no one here wrote, fed by a running kvsp cluster's instances: for several prompts, after
G1 and G2 evictions and after an instance is SIGKILLed and restarted, Dynamo's answer of which
instance holds how many of a prompt's tokens, per medium, equals kvsp's own (the controller's
router query over the IS's records).

Dynamo's indexer runs in a network namespace of its own (``tests.servers.DynamoIndexer``); the
instances publish on IPC sockets, which cross namespaces."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.local import LocalCluster
from tests.conftest import ROOT
from tests.servers import DynamoIndexer

DYNAMO = ROOT / "build" / "peers" / "dynamo"
MODEL = "smollm2"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (DYNAMO / ".installed").exists(),
        reason="Dynamo's indexer (ai-dynamo-runtime 1.6.1) could not be installed by "
        "`make consumer-deps`",
    ),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # G1 of 6 blocks and G2 of 4 MB (5 blocks): a few prompts evict from both
    c = LocalCluster(
        tmp_path_factory.mktemp("cluster"), instances=2, g1_blocks=6, g2_bytes="4M",
        kv_events="ipc", record_ttl_ms=3_000,
    )  # fmt: skip
    c.start()
    try:
        yield c
    finally:
        c.stop()


def complete(c: LocalCluster, prompt: list[int]) -> None:
    answer = httpx.post(
        c.frontend.url + "v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        headers={"authorization": f"Bearer {c.api_key}"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text


def views(c: LocalCluster, dynamo: DynamoIndexer, prompt: list[int]) -> tuple[Any, Any]:
    """Per instance, (gpu, cpu, disk) tokens of ``prompt``: kvsp's answer, Dynamo's."""
    tenant = next(iter(c.api_keys))
    kvsp = httpx.post(
        c.controller.url + "query",
        json={"tenant": tenant, "token_ids": prompt},
        headers={"authorization": f"Bearer {c.router_token}"},
        timeout=30,
    )
    assert kvsp.status_code == 200, kvsp.text
    found = kvsp.json()["instances"]
    theirs = dynamo.call("POST", "query", {"token_ids": prompt, "model_name": MODEL})["instances"]
    ours_by, theirs_by = {}, {}
    for n, process in enumerate(c.instance_processes):
        mine = found.get(process.url, {})
        other = theirs.get(str(n + 1), {})
        ours_by[n] = tuple(mine.get(m, 0) for m in ("gpu", "cpu", "disk"))
        theirs_by[n] = tuple(other.get(m, 0) for m in ("gpu", "cpu", "disk"))
    return ours_by, theirs_by


def agree(c: LocalCluster, dynamo: DynamoIndexer, prompts: list[list[int]]) -> list[Any]:
    """Every prompt's views, once they agree (events and records travel apart); the last
    disagreement if they do not within 20 s."""
    deadline = time.monotonic() + 20
    while True:
        seen = [views(c, dynamo, p) for p in prompts]
        if all(ours == theirs for ours, theirs in seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.3)


def test_dynamos_indexer_sees_what_kvsp_sees(cluster: LocalCluster, tmp_path: Path) -> None:
    dynamo = DynamoIndexer(DYNAMO / "bin" / "python", tmp_path / "dynamo.log")
    try:
        for n, (endpoint, replay) in enumerate(cluster.kv_event_endpoints):
            dynamo.call("POST", "register", {
                "instance_id": n + 1, "endpoint": endpoint, "replay_endpoint": replay,
                "model_name": MODEL, "block_size": 16,
            })  # fmt: skip
        base = list(range(2000, 2032))  # two blocks every prompt shares
        prompts = [base + list(range(3000 + 100 * i, 3000 + 100 * i + 16 * (1 + i % 3)))
                   for i in range(6)]  # fmt: skip
        checked = []
        for prompt in prompts:
            complete(cluster, prompt)
            checked.append(prompt)
            seen = agree(cluster, dynamo, checked)
            if [o for o, _ in seen] != [t for _, t in seen]:
                Path("/tmp/dump.json").write_text(json.dumps(dynamo.call("GET", "dump")))
            assert [o for o, _ in seen] == [t for _, t in seen], seen
        # the cluster held the prompts somewhere, and evictions demoted some out of G1
        final = [ours for ours, _ in agree(cluster, dynamo, prompts)]
        assert any(v[0] for view in final for v in view.values())
        assert any(v[1] > v[0] for view in final for v in view.values())
        # an instance dies and comes back: a new epoch, an empty pool
        victim = cluster.instance_processes[0]
        assert victim.popen is not None
        victim.popen.send_signal(signal.SIGKILL)
        victim.popen.wait()
        victim.start()
        deadline = time.monotonic() + 120
        while not victim.healthy():
            assert time.monotonic() < deadline, "the restarted instance did not answer"
            time.sleep(0.2)
        cluster.wait_active(2, 60)
        time.sleep(3.5)  # the dead process's records run out (their TTL is 3 s)
        after = agree(cluster, dynamo, prompts)
        assert [o for o, _ in after] == [t for _, t in after], after
        assert all(ours[0] == (0, 0, 0) for ours, _ in after)
        for prompt in prompts[:3]:  # and what it holds from now on, both see alike
            complete(cluster, prompt)
        again = agree(cluster, dynamo, prompts)
        assert [o for o, _ in again] == [t for _, t in again], again
    finally:
        dynamo.stop()
