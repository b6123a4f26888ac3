"""The KVSP Index Service: replica records, prefix lookup with placement estimates (6.1, 6.2)."""

__all__: list[str] = []
