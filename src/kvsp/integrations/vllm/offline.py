"""Prompts through vLLM in this process, with a KV connector, reporting what each request
reused: ``python -m kvsp.integrations.vllm.offline SPEC.json`` prints one JSON line per prompt.

It is how a deployment checks its connector settings before serving, and how the tests and the
connector benchmark drive vLLM in processes of their own. ``SPEC.json``::

    {"model_dir": "...", "connector": "KVSPConnector" | "ExampleConnector" | null,
     "extra_config": {...}, "max_tokens": 16, "block_size": 128, "kv_cache_gib": 1,
     "prompts": [[token ids] | {"tokens": [...], "kv_transfer_params": {...}}, ...]}

Each line: ``{"tokens": [...], "cached_tokens": n, "seconds": s, "kv_transfer_params": {...}}``
(``seconds``: the whole request; with ``max_tokens`` 1, the time to the first token).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kvsp.integrations.vllm.engine import vllm_environment

__all__ = ["main", "run"]


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    vllm_environment(int(spec.get("kv_cache_gib", 1)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model = Path(spec["model_dir"]).expanduser() / "safetensors"
    connector = spec.get("connector")
    transfer = None
    if connector is not None:
        transfer = KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec.get("extra_config", {}),
        )
    llm = LLM(
        model=str(model),
        dtype="float32",
        max_model_len=int(spec.get("max_model_len", 4096)),
        block_size=int(spec.get("block_size", 128)),
        enforce_eager=True,
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        kv_transfer_config=transfer,
        seed=0,
        distributed_executor_backend="uni",
    )
    out = []
    for prompt in spec["prompts"]:
        entry = prompt if isinstance(prompt, dict) else {"tokens": prompt}
        transfer_params = entry.get("kv_transfer_params")
        params = SamplingParams(
            max_tokens=int(spec.get("max_tokens", 16)),
            temperature=0.0,
            extra_args=None if transfer_params is None else {"kv_transfer_params": transfer_params},
        )
        started = time.perf_counter()
        (result,) = llm.generate(
            [TokensPrompt(prompt_token_ids=list(entry["tokens"]))], params, use_tqdm=False
        )
        out.append(
            {
                "tokens": list(result.outputs[0].token_ids),
                "cached_tokens": result.num_cached_tokens,
                "seconds": time.perf_counter() - started,
                "kv_transfer_params": result.kv_transfer_params,
            }
        )
    llm.llm_engine.engine_core.shutdown()  # the connector's saves in flight finish first
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    for line in run(spec):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
