"""Rewrite a section of benchmarks/RESULTS.md ("Latest run" unless a second argument names
another) from the JSON lines the benchmarks printed (``make bench`` and ``make bench-peers``
collect them in a file), with the date and the machine."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def section(head: str, lines: list[str]) -> str:
    runs = []
    for line in lines:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue  # a script's other output
        if isinstance(doc, dict) and "benchmark" in doc:
            runs.append(f"- `{doc['benchmark']}`: `{json.dumps(doc, separators=(',', ':'))}`")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{head}\n{when}, {machine()}.\n\n" + "\n".join(runs) + "\n\n"


def main() -> None:
    lines = Path(sys.argv[1]).read_text().splitlines()
    head = f"## {sys.argv[2] if len(sys.argv) > 2 else 'Latest run'}\n"
    text = RESULTS.read_text()
    start = text.index(head)
    end = text.index("\n## ", start + len(head)) + 1
    RESULTS.write_text(text[:start] + section(head, lines) + text[end:])


if __name__ == "__main__":
    main()
