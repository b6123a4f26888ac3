"""The loop every peer driver runs: one JSON command per line on standard input, one JSON answer
per line on standard output. A driver runs under its peer's own interpreter (each peer lives in
a virtual environment of its own under build/peers/), so it imports nothing of kvsp's; the
benchmark in kvsp's environment sends it the same commands round by round, between its own
measurements of kvsp."""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["serve", "threaded_rate"]

Handler = Callable[..., dict[str, Any]]


def serve(handlers: dict[str, Handler]) -> None:
    """Answer commands ``{"op": name, ...}`` with ``handlers[name](**rest)`` until standard
    input closes; an exception is answered as ``{"error": ...}`` and the loop goes on. Stray
    output of the peer's own libraries goes to standard error, never into the answers."""
    answers = sys.stdout
    sys.stdout = sys.stderr
    for line in sys.stdin:
        command = json.loads(line)
        op = command.pop("op")
        try:
            answer = handlers[op](**command)
        except Exception:  # the benchmark shows the peer's own traceback
            answer = {"error": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def threaded_rate(
    call: Callable[[int, int], int], clients: int, count: int, seconds: float
) -> float:
    """Octets/s of ``clients`` threads, thread ``i`` calling ``call(i, n)`` (which returns the
    octets it received) for n = i, i + 1, ... modulo ``count``, for ``seconds``."""
    stop = time.perf_counter() + seconds
    done = [0] * clients

    def client(i: int) -> None:
        n = i
        while time.perf_counter() < stop:
            done[i] += call(i, n % count)
            n += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - start)
