"""Running one pipe of Redis commands for the Index Service's and the controller's Redis stores.

Both stores talk to Redis only through pipes, so this is the one place where a Redis failure
becomes a 503 and where a pipe's pooled connection is handed back whatever happens: the client's
own ``execute`` keeps the connection when it is cancelled or fails while loading the pipe's
scripts, and a leader whose tasks are cancelled must not leak one per call.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvsp.core.problems import ServiceUnavailable

__all__ = ["run_pipe"]

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError)


async def run_pipe(pipe: Any, what: str) -> list[Any]:
    """Execute ``pipe``; ``what`` names the Redis state in the 503 when it cannot answer."""
    try:
        async with pipe:
            result: list[Any] = await pipe.execute()
    except _UNREACHABLE as exc:
        raise ServiceUnavailable(f"{what} is unreachable: {exc}") from None
    except ResponseError as exc:
        raise ServiceUnavailable(f"{what} refused a command: {exc}") from None
    return result
