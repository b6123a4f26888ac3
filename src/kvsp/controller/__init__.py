"""The KVSP Placement Controller: instances, placement, prefetch, sessions, resharding
(6.3, 6.4, 6.5, 6.8, 6.9)."""

__all__: list[str] = []
