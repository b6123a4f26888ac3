"""What an instance sends its controller: status reports (KVSP 6.4) and session checkpoints
(6.8), each answered with what the controller decided."""

from __future__ import annotations

from kvsp.core.records import InstanceState, InstanceStatusRecord, SessionCheckpoint
from kvsp.web.client import JsonClient

__all__ = ["ControllerClient"]


class ControllerClient(JsonClient):
    peer = "controller"

    async def put_status(self, status: InstanceStatusRecord) -> InstanceState:
        """Report the status; the state the controller holds this instance in."""
        body = status.model_dump_json(exclude_none=True).encode()
        return InstanceState((await self._send("PUT", "status", body)).json()["state"])

    async def checkpoint(self, checkpoint: SessionCheckpoint) -> int:
        """Send a checkpoint; the output offset the controller acknowledges."""
        path = f"sessions/{checkpoint.session}/checkpoint"
        response = await self._send("PUT", path, checkpoint.model_dump_json().encode())
        return int(response.json()["acknowledged"])
