"""vLLM general plugin: makes ``KVSPConnector`` known by name in every vLLM process.

Installed as the ``vllm.general_plugins`` entry point ``kvsp``; vLLM calls ``register`` in the
API server, the engine core and each worker before it builds a connector, so
``--kv-transfer-config '{"kv_connector": "KVSPConnector", ...}'`` works with no module path.
"""

from __future__ import annotations

__all__ = ["register"]


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "KVSPConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            "KVSPConnector", "kvsp.integrations.vllm.connector", "KVSPConnector"
        )
