"""kvsp's compiled parts: the Index Service's block-key table (docs/decisions/0006), its
splitter of publish batches (docs/decisions/0030) and the two-lane SHA-256 that verifies
received blocks (docs/decisions/0007). Everything else is declared in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            f"kvsp.{name}",
            sources=[f"src/kvsp/{name.replace('.', '/')}.c"],
            depends=["src/kvsp/index/_hex.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
            # each has a pure-Python fallback (kvsp.index.keytable, kvsp.index.puts, hashlib in
            # kvsp.core.sha256): a machine without a C compiler still installs and runs kvsp,
            # slower
            optional=True,
        )
        for name in ("index._keytable", "index._puts", "core._sha256")
    ]
)
