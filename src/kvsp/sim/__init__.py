"""The cluster simulator: the real control-plane code driven in virtual time."""

__all__: list[str] = []
