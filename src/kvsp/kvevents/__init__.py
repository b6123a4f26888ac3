"""KV events in vLLM's wire format: what kvsp publishes and what it reads from vLLM pods."""

__all__: list[str] = []
