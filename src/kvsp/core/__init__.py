"""The sans-IO protocol core shared by every kvsp service, client, the simulator and the engine.

Nothing here performs network I/O, uses asyncio, or imports torch: functions take values (and a
``Clock`` where time matters) and return values or raise ``kvsp.core.problems`` errors.
Modules: ``compat`` (descriptor, Compatibility ID), ``keys`` (Scope IDs, Block Keys),
``container`` (KVB1), ``records`` (wire models), ``digests`` (Repr-Digest), ``cost`` (6.4
estimates), ``clock``, ``ids``, ``registries``, ``problems``.
"""

__all__: list[str] = []
