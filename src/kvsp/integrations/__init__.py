"""Integrations of kvsp with inference engines made elsewhere (vLLM)."""

__all__: list[str] = []
