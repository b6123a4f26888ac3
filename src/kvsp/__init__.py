"""kvsp: the KV Cache Storage Protocol and session-aware KV cache management.

The pure protocol core lives in ``kvsp.core``; services, clients and the engine build on it.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
