"""Rewrite the "Latest run" section of benchmarks/RESULTS.md from the JSON lines the benchmarks
printed (``make bench`` collects them in a file), with the date and the machine."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
HEAD = "## Latest run\n"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def section(lines: list[str]) -> str:
    runs = []
    for line in lines:
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue  # a script's other output
        if isinstance(doc, dict) and "benchmark" in doc:
            runs.append(f"- `{doc['benchmark']}`: `{json.dumps(doc, separators=(',', ':'))}`")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{HEAD}\n{when}, {machine()}.\n\n" + "\n".join(runs) + "\n\n"


def main() -> None:
    lines = Path(sys.argv[1]).read_text().splitlines()
    text = RESULTS.read_text()
    start = text.index(HEAD)
    end = text.index("\n## ", start + len(HEAD)) + 1
    RESULTS.write_text(text[:start] + section(lines) + text[end:])


if __name__ == "__main__":
    main()
