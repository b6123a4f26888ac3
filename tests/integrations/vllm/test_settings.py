"""The connector's settings: what a deployment writes in kv_connector_extra_config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvsp.core.problems import ConfigurationError
from kvsp.integrations.vllm.settings import ConnectorSettings
from kvsp.model import ModelFiles
from tests.integration.instances import tenants_toml


@pytest.fixture
def extra(tmp_path: Path, model_files: ModelFiles) -> dict[str, Any]:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants_toml(model_files.compat_id.hex()))
    return {
        "index_url": "http://127.0.0.1:9100/kvsp",
        "holder_url": "http://127.0.0.1:9101/kvsp/",
        "tenants_file": str(tenants),
        "model_dir": str(model_files.folder),
    }


def test_settings_read_with_defaults(extra: dict[str, Any], model_files: ModelFiles) -> None:
    s = ConnectorSettings.parse(extra)
    assert s.index_url == "http://127.0.0.1:9100/kvsp/"
    assert s.copy_urls == ()
    assert s.token is None
    assert s.layer_chunk == 0
    assert s.descriptor.compat_id() == model_files.compat_id
    # the model folder is found around vLLM's safetensors folder when not given
    del extra["model_dir"]
    assert ConnectorSettings.parse(extra, str(model_files.weights)).files == s.files


def test_no_tenant_means_no_kvsp_and_request_tenants_only_when_trusted(
    extra: dict[str, Any],
) -> None:
    s = ConnectorSettings.parse(extra)
    assert s.tenant_of(None) is None
    assert s.tenant_of({"kvsp": {"tenant": "acme"}}) is None  # a client may not pick one
    s = ConnectorSettings.parse({**extra, "tenant": "acme"})
    assert s.tenant_of(None).name == "acme"  # type: ignore[union-attr]
    assert s.tenant_of({"kvsp": {"tenant": "other"}}).name == "acme"  # type: ignore[union-attr]
    s = ConnectorSettings.parse({**extra, "request_tenants": True})
    assert s.tenant_of({"kvsp": {"tenant": "other"}}).name == "other"  # type: ignore[union-attr]
    assert s.tenant_of({"kvsp": {"tenant": "nobody"}}) is None
    assert s.tenant_of({"kvsp": "acme"}) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"indx_url": "x"}, "unknown KVSPConnector settings: indx_url"),
        ({"index_url": None}, "'index_url' must be a non-empty string"),
        ({"tenant": "nobody"}, "tenant 'nobody' is not in"),
        ({"request_tenants": "yes"}, "must be a boolean"),
        ({"layer_chunk": -1}, "'layer_chunk' must be an integer"),
        ({"copy_urls": "http://x/"}, "must be a list of URLs"),
        ({"timeout_s": 0}, "positive number"),
        ({"model_dir": "/nonexistent"}, "run `kvsp model install` first"),
        ({"tenants_file": "/nonexistent.toml"}, "cannot read tenants file"),
    ],
)
def test_bad_settings_are_refused_with_the_reason(
    extra: dict[str, Any], change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        ConnectorSettings.parse({**extra, **change})
