"""The connector's settings, read from vLLM's ``kv_transfer_config.kv_connector_extra_config``.

Example (``--kv-transfer-config`` on vLLM's command line)::

    {"kv_connector": "KVSPConnector", "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {
        "index_url": "http://127.0.0.1:9100/kvsp/",
        "holder_url": "http://127.0.0.1:9101/kvsp/",
        "copy_urls": ["http://127.0.0.1:9102/kvsp/"],
        "token": "...", "tenants_file": "tenants.toml", "tenant": "acme",
        "model_dir": "~/.cache/kvsp/models/smollm2-135m-instruct-0.1.2"}}

KvHints that requests carry are executed only with ``request_hints`` true, for the same reason.
Which tenant's scope a request is keyed with: ``kv_transfer_params["kvsp"]["tenant"]`` when
``request_tenants`` is true (only behind a front end that sets it and drops what clients send,
since vLLM's server passes ``kv_transfer_params`` on from clients), else ``tenant``. A request
with neither gets no KVSP at all: there is no shared default scope. Unknown settings are refused,
so a misspelt one cannot silently turn a feature off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp.core.compat import CompatibilityDescriptor
from kvsp.core.problems import ConfigurationError, Forbidden, NotFound
from kvsp.core.urls import canonical_url
from kvsp.model import ModelFiles, from_folder, system_prefix
from kvsp.tenants import Tenant, Tenants

__all__ = ["ConnectorSettings"]

_KEYS = frozenset(
    {
        "index_url",
        "holder_url",
        "copy_urls",
        "token",
        "tenants_file",
        "tenant",
        "request_tenants",
        "request_hints",
        "local_reads",
        "model_dir",
        "block_tokens",
        "layer_chunk",
        "timeout_s",
    }
)


def _text(extra: Mapping[str, Any], key: str, required: bool = False) -> str | None:
    value = extra.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigurationError(f"KVSPConnector setting {key!r} must be a non-empty string")
    return value


def _int(extra: Mapping[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigurationError(f"KVSPConnector setting {key!r} must be an integer {low}-{high}")
    return value


@dataclass(frozen=True)
class ConnectorSettings:
    index_url: str
    #: where completed blocks are stored (None: the connector only loads)
    holder_url: str | None
    #: holders that also get a copy of every saved block (a copy that outlives this process)
    copy_urls: tuple[str, ...]
    token: str | None
    tenants: Tenants
    #: the tenant of requests that name none (None: such requests get no KVSP)
    tenant: str | None
    request_tenants: bool
    #: execute the KvHints requests carry (vLLM's ``kv_hints``, Dynamo's
    #: ``kv_transfer_params.kv_hint``); only behind a router that sets them
    request_hints: bool
    #: read blocks of a holder in this process (the vLLM instance's own) without HTTP
    local_reads: bool
    files: ModelFiles
    #: most layers per GET (0: a GET per run of layers the holder keeps in one tier); every
    #: GET is streamed and each layer written as it arrives either way
    layer_chunk: int
    timeout_s: float

    @property
    def descriptor(self) -> CompatibilityDescriptor:
        return self.files.descriptor

    @classmethod
    def parse(cls, extra: Mapping[str, Any], vllm_model: str | None = None) -> ConnectorSettings:
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ConfigurationError(f"unknown KVSPConnector settings: {', '.join(unknown)}")
        index_url = canonical_url(_text(extra, "index_url", required=True) or "")
        holder = _text(extra, "holder_url")
        tenants_file = _text(extra, "tenants_file", required=True) or ""
        model_dir = _text(extra, "model_dir")
        if model_dir is None:
            if vllm_model is None:
                raise ConfigurationError("KVSPConnector needs 'model_dir' (a kvsp model folder)")
            folder = Path(vllm_model).expanduser().parent  # the kvsp folder around safetensors/
        else:
            folder = Path(model_dir).expanduser()
        files = from_folder(folder, _int(extra, "block_tokens", 16, 1, 1 << 16))
        tenants = Tenants.load(Path(tenants_file).expanduser(), system_prefix(files))
        tenant = _text(extra, "tenant")
        if tenant is not None:
            try:
                tenants.get(tenant)
            except NotFound:
                raise ConfigurationError(
                    f"KVSPConnector tenant {tenant!r} is not in {tenants_file}"
                ) from None
        request_tenants, request_hints, local_reads = (
            extra.get(key, default)
            for key, default in (
                ("request_tenants", False),
                ("request_hints", False),
                ("local_reads", True),
            )
        )
        for key, value in (
            ("request_tenants", request_tenants),
            ("request_hints", request_hints),
            ("local_reads", local_reads),
        ):
            if not isinstance(value, bool):
                raise ConfigurationError(f"KVSPConnector setting {key!r} must be a boolean")
        copies = extra.get("copy_urls", [])
        if not isinstance(copies, list) or not all(isinstance(u, str) and u for u in copies):
            raise ConfigurationError("KVSPConnector setting 'copy_urls' must be a list of URLs")
        timeout = extra.get("timeout_s", 30.0)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ConfigurationError("KVSPConnector setting 'timeout_s' must be a positive number")
        return cls(
            index_url=index_url,
            holder_url=None if holder is None else canonical_url(holder),
            copy_urls=tuple(canonical_url(u) for u in copies),
            token=_text(extra, "token"),
            tenants=tenants,
            tenant=tenant,
            request_tenants=request_tenants,
            request_hints=request_hints,
            local_reads=local_reads,
            files=files,
            layer_chunk=_int(extra, "layer_chunk", 0, 0, 1 << 16),
            timeout_s=float(timeout),
        )

    def tenant_of(self, params: Mapping[str, Any] | None) -> Tenant | None:
        """The tenant a request is served for, or None (no KVSP for it)."""
        asked = None
        if self.request_tenants and params is not None:
            kvsp = params.get("kvsp")
            if isinstance(kvsp, Mapping) and isinstance(kvsp.get("tenant"), str):
                asked = kvsp["tenant"]
        name = asked if asked is not None else self.tenant
        if name is None:
            return None
        try:
            tenant = self.tenants.get(name)
            tenant.check_compat(self.descriptor.compat_id().hex())
        except (NotFound, Forbidden):
            return None
        return tenant
