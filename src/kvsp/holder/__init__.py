"""The KVSP holder: tiered block storage with leases, served over HTTP (6.1, 6.6, 6.7)."""

__all__: list[str] = []
