"""Prompts through vLLM in this process, with a KV connector, reporting what each request
reused: ``python -m kvsp.integrations.vllm.offline SPEC.json`` prints one JSON line per prompt.

It is how a deployment checks its connector settings before serving, and how the tests and the
connector benchmark drive vLLM in processes of their own. ``SPEC.json``::

    {"model_dir": "...", "connector": "KVSPConnector" | "ExampleConnector" | null,
     "extra_config": {...}, "max_tokens": 16, "block_size": 128, "kv_cache_gib": 1,
     "prefix_caching": false, "kv_events": "ipc://..." (vLLM's KV events, for the connector),
     "metrics": false (true: a last line {"metrics": {name: value}} of vLLM's Prometheus
     series, the connector's ``vllm:kvsp_*`` among them),
     "prompts": [[token ids] | {"tokens": [...], "kv_transfer_params": {...},
                                "session_id": "...", "kv_hints": {envelope}}, ...]}

Each line: ``{"tokens": [...], "cached_tokens": n, "seconds": s, "kv_transfer_params": {...}}``
(``seconds``: the whole request; with ``max_tokens`` 1, the time to the first token).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from kvsp.integrations.vllm.engine import vllm_environment

__all__ = ["main", "run"]


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    vllm_environment(int(spec.get("kv_cache_gib", 1)))
    from vllm import LLM, RequestOutput, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
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
        kv_events_config=None
        if spec.get("kv_events") is None
        else KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=spec["kv_events"]
        ),
        seed=0,
        distributed_executor_backend="uni",
        disable_log_stats=not spec.get("metrics", False),
    )
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    engine = llm.llm_engine
    out = []
    for n, prompt in enumerate(spec["prompts"]):
        entry = prompt if isinstance(prompt, dict) else {"tokens": prompt}
        transfer_params = entry.get("kv_transfer_params")
        params = SamplingParams(
            max_tokens=int(spec.get("max_tokens", 16)),
            temperature=0.0,
            extra_args=None if transfer_params is None else {"kv_transfer_params": transfer_params},
        )
        hints = entry.get("kv_hints")
        envelope = None
        if hints is not None:
            actions = [KvHintAction(**a) for a in hints["actions"]]
            envelope = KvHintsEnvelope(hints["protocol_version"], hints["message_id"], actions)
        started = time.perf_counter()
        request = f"prompt-{n}"
        engine.add_request(
            request,
            TokensPrompt(prompt_token_ids=list(entry["tokens"])),
            params,
            session_id=entry.get("session_id"),
            kv_hints=envelope,
        )
        result: RequestOutput | None = None
        while result is None:
            for output in engine.step():
                if output.request_id == request and output.finished:
                    assert isinstance(output, RequestOutput), "a generation request"
                    result = output
        out.append(
            {
                "tokens": list(result.outputs[0].token_ids),
                "cached_tokens": result.num_cached_tokens,
                "seconds": time.perf_counter() - started,
                "kv_transfer_params": result.kv_transfer_params,
            }
        )
    if spec.get("metrics", False):  # vLLM's own Prometheus series, as its /metrics has them
        totals: dict[str, float] = {}
        for metric in llm.get_metrics():
            if isinstance(getattr(metric, "value", None), int | float):
                totals[metric.name] = totals.get(metric.name, 0) + metric.value  # type: ignore[attr-defined]
        out.append({"metrics": totals})
    llm.llm_engine.engine_core.shutdown()  # the connector's saves in flight finish first
    return out


def main() -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvsp").setLevel(logging.INFO)  # the hint outcomes, among others
    spec = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    for line in run(spec):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
