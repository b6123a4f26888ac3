"""The inference instance: a real engine whose KV cache speaks KVSP."""

__all__: list[str] = []
