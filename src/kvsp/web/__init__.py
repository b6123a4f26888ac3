"""HTTP plumbing shared by every kvsp service and client: problem documents, bodies, auth."""

__all__: list[str] = []
