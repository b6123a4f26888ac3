"""Locks the public surface: every name in ``__all__`` exists, nothing private leaks, and the
sans-IO core imports no I/O framework."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import kvsp

PACKAGE = Path(kvsp.__file__).parent


def _module_name(path: Path) -> str:
    parts = [p for p in path.relative_to(PACKAGE).with_suffix("").parts if p != "__init__"]
    return ".".join(["kvsp", *parts])


PUBLIC_MODULES = sorted(_module_name(p) for p in PACKAGE.rglob("*.py") if p.name != "__main__.py")
CORE = PACKAGE / "core"
FORBIDDEN_IN_CORE = {
    "asyncio",
    "httpx",
    "fastapi",
    "starlette",
    "uvicorn",
    "redis",
    "torch",
    "socket",
    "zmq",
}


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_explicit_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(exported) == len(set(exported))
    assert all(hasattr(module, attr) for attr in exported)
    assert not any(attr.startswith("_") and not attr.endswith("__") for attr in exported)


#: the flat public API: the protocol surface and the clients (changing it is a decision)
FLAT_API = {
    "__version__",
    # KVSP 4.1-4.3: descriptors and IDs, Scope IDs and Block Keys, containers
    "CompatibilityDescriptor", "compute_compat_id", "model_digest", "parse_compat_id",
    "scope_id", "parse_scope_id", "block_keys", "BlockKeyChain", "parse_block_key",
    "Container", "layer_digest", "replica_digest",
    # KVSP 4.4 and 6: records
    "ReplicaRecord", "ReplicaRef", "LookupRequest", "LookupResponse", "InstanceStatusRecord",
    "SessionCheckpoint", "Sampler", "PrefetchDirective", "PrefetchStatus", "LeaseRequest",
    "LeaseGrant", "ShardMap",
    # the error tree (each an RFC 9457 problem type)
    "KvspError", "InvalidInput", "DescriptorError", "KeyMaterialError", "RecordError",
    "ContainerError", "DigestError", "ConfigurationError", "Unauthenticated", "Forbidden",
    "NotFound", "LayersUnavailable", "MethodNotAllowed", "StaleEpoch", "IllegalTransition",
    "InstanceFailed", "NotAccepting", "AlreadyStored", "PayloadTooLarge", "LeaseQuotaExceeded",
    "ServiceUnavailable", "NotLeader", "CapacityExhausted",
    # clients of kvsp's services
    "IndexClient", "HolderClient",
}  # fmt: skip


def test_the_flat_api_is_exactly_the_protocol_surface() -> None:
    assert set(kvsp.__all__) == FLAT_API
    for name in kvsp.__all__:
        value = getattr(kvsp, name)
        if isinstance(value, type):  # the very object its own module defines, not a copy
            assert getattr(importlib.import_module(value.__module__), name) is value
    with pytest.raises(AttributeError):
        kvsp.NotAName  # noqa: B018


def test_importing_kvsp_loads_no_http_client() -> None:
    probe = "import sys, kvsp; print('httpx' in sys.modules, 'asyncio' in sys.modules)"
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert found.stdout.split() == ["False", "False"]


def test_packages_are_found() -> None:
    assert {"kvsp", "kvsp.core", "kvsp.core.keys", "kvsp.cli"} <= set(PUBLIC_MODULES)


#: State machines outside the core that must stay free of I/O frameworks too.
STATE_MODULES = [
    PACKAGE / "index" / "replicas.py",
    PACKAGE / "index" / "rules.py",
    PACKAGE / "index" / "statuses.py",
    PACKAGE / "index" / "wire.py",
    PACKAGE / "index" / "keytable.py",
    PACKAGE / "index" / "packed.py",
    PACKAGE / "holder" / "blocks.py",
    PACKAGE / "holder" / "store.py",
    PACKAGE / "holder" / "leases.py",
    PACKAGE / "controller" / "instances.py",
    PACKAGE / "controller" / "placement.py",
    PACKAGE / "controller" / "sessions.py",
    PACKAGE / "controller" / "reshard.py",
    PACKAGE / "controller" / "overlap.py",
    PACKAGE / "kvevents" / "wire.py",
    PACKAGE / "kvevents" / "feed.py",
    PACKAGE / "kvevents" / "pods.py",
    PACKAGE / "instance" / "hints.py",
    PACKAGE / "instance" / "kvpool.py",
    PACKAGE / "instance" / "links.py",
    PACKAGE / "instance" / "release.py",
    PACKAGE / "instance" / "sampling.py",
    PACKAGE / "instance" / "shards.py",
    PACKAGE / "integrations" / "vllm" / "g1.py",
    PACKAGE / "integrations" / "vllm" / "plans.py",
    PACKAGE / "integrations" / "vllm" / "stored.py",
]


@pytest.mark.parametrize(
    "path", sorted(CORE.glob("*.py")) + STATE_MODULES, ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_core_is_sans_io(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN_IN_CORE


#: what a pure module may not pull in, however indirectly (the event loop, HTTP, the engines)
FRAMEWORKS = (
    "asyncio", "httpx", "starlette", "uvicorn", "fastapi", "redis", "torch", "vllm", "zmq"
)  # fmt: skip
PURE_MODULES = sorted(
    {_module_name(p) for p in [*CORE.glob("*.py"), *STATE_MODULES]}
    | {
        "kvsp.auth",
        "kvsp.quotas",
        "kvsp.instance.session_index",
        "kvsp.controller.hints",
        "kvsp.web.context",
    }
)


@pytest.mark.parametrize("name", PURE_MODULES)
def test_pure_modules_pull_in_no_framework_even_indirectly(name: str) -> None:
    """Imported alone in a fresh interpreter, a pure module leaves no I/O framework loaded."""
    probe = (
        f"import importlib, sys; importlib.import_module({name!r}); "
        f"print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert found == "", f"{name} pulls in {found}"


#: which packages a package may not import: services never import each other's, and the core
#: and the shared configuration (auth, tenants, quotas, model) import no service
LAYERS = {
    "core": ("kvsp.holder", "kvsp.index", "kvsp.instance", "kvsp.controller", "kvsp.integrations",
             "kvsp.frontend", "kvsp.auth", "kvsp.tenants", "kvsp.quotas", "kvsp.model", "kvsp.web"),
    "holder": ("kvsp.instance", "kvsp.controller", "kvsp.integrations", "kvsp.frontend"),
    "index": ("kvsp.holder", "kvsp.instance", "kvsp.controller", "kvsp.integrations",
              "kvsp.frontend"),
    "instance": ("kvsp.controller", "kvsp.integrations", "kvsp.frontend"),
    "controller": ("kvsp.instance", "kvsp.integrations", "kvsp.frontend"),
    "integrations": ("kvsp.controller", "kvsp.frontend"),
    # the front end calls the controller and streams from instances over HTTP
    "frontend": ("kvsp.holder", "kvsp.index", "kvsp.instance", "kvsp.integrations"),
}  # fmt: skip
SHARED = ("auth.py", "tenants.py", "quotas.py", "model.py")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_no_package_imports_up_or_across_the_layers(package: str) -> None:
    wrong = [
        (str(path.relative_to(PACKAGE)), name)
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for name in sorted(_imports(path))
        if name.startswith(LAYERS[package])
    ]
    assert wrong == []


@pytest.mark.parametrize("name", SHARED)
def test_the_shared_configuration_imports_no_service(name: str) -> None:
    services = ("kvsp.holder", "kvsp.index", "kvsp.instance", "kvsp.controller", "kvsp.web")
    assert not [n for n in _imports(PACKAGE / name) if n.startswith(services)]
