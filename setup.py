"""The one compiled part of kvsp: the Index Service's block-key table (docs/decisions/0006).
Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvsp.index._keytable",
            sources=["src/kvsp/index/_keytable.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
        )
    ]
)
