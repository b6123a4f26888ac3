"""``python -m kvsp``: the same entry point as the ``kvsp`` console script."""

from kvsp.cli import main

main()
