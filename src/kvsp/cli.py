"""The ``kvsp`` command line: thin calls into the package, stable for scripts.

Invalid input to any subcommand prints one line on stderr naming what is wrong and exits with
status 2, whether click rejected the arguments or kvsp rejected the data.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from pydantic import SecretStr

# typer vendors click; its exceptions are only reachable here (pinned typer range).
from typer._click.exceptions import ClickException, NoArgsIsHelpError

from kvsp.auth import Principals
from kvsp.core.compat import CompatibilityDescriptor
from kvsp.core.container import Container
from kvsp.core.ids import parse_block_key, parse_compat_id
from kvsp.core.keys import ROOT_PARENT, block_keys, scope_id
from kvsp.core.problems import InvalidInput, KvspError
from kvsp.core.registries import CODEC_RAW
from kvsp.quotas import Quotas, parse_octets
from kvsp.settings import settings_command
from kvsp.sim.scenario import DEFAULT_SCENARIO

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from kvsp.local import LocalCluster
    from kvsp.web.openapi import Op

__all__ = ["app", "main"]

USAGE_ERROR = 2

app = typer.Typer(
    name="kvsp",
    help="KV Cache Storage Protocol tools and services.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
container_app = typer.Typer(
    help="Build and inspect KV Block Containers (KVB1).", no_args_is_help=True
)
app.add_typer(container_app, name="container")
index_app = typer.Typer(
    help="The Index Service (replica records and lookup).", no_args_is_help=True
)
app.add_typer(index_app, name="index")
holder_app = typer.Typer(
    help="A holder: tiered KV block storage with leases.", no_args_is_help=True
)
app.add_typer(holder_app, name="holder")
controller_app = typer.Typer(
    help="The Placement Controller (instances, placement, sessions, resharding).",
    no_args_is_help=True,
)
app.add_typer(controller_app, name="controller")
frontend_app = typer.Typer(
    help="The OpenAI-compatible front end, on its own, before several controllers.",
    no_args_is_help=True,
)
app.add_typer(frontend_app, name="frontend")
instance_app = typer.Typer(
    help="An inference instance on the default model (also a holder).", no_args_is_help=True
)
app.add_typer(instance_app, name="instance")
model_app = typer.Typer(help="The default model (SmolLM2-135M-Instruct).", no_args_is_help=True)
app.add_typer(model_app, name="model")
config_app = typer.Typer(help="Services' settings files (--config FILE).", no_args_is_help=True)
app.add_typer(config_app, name="config")
tenants_app = typer.Typer(help="The tenants file (scope keys, API keys, quotas).",
                          no_args_is_help=True)  # fmt: skip
app.add_typer(tenants_app, name="tenants")


@config_app.command("check")
def config_check_command(
    file: Annotated[Path, typer.Argument(help="settings file (TOML): one table per service")],
) -> None:
    """Print each service's effective settings in FILE, its KVSP_* environment applied, with
    secrets masked; exit 2 when a table or a setting is invalid."""
    from kvsp.settings import check_file

    sys.stdout.write(json.dumps(check_file(file), indent=2) + "\n")


@tenants_app.command("quotas")
def tenants_quotas_command(
    tenants: Annotated[Path, typer.Argument(help="tenants file (TOML, secret)")],
) -> None:
    """Print the tenants' quotas keyed by Scope ID (no secret in it): the --quotas file of
    holders and the Index Service."""
    from kvsp.tenants import Tenants

    sys.stdout.write(Tenants.load(tenants).quotas.to_toml())


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read {what} {path}: {exc.strerror}") from None


def _hex_octets(text: str, what: str) -> bytes:
    if re.fullmatch(r"(?:[0-9a-fA-F]{2})+", text) is None:
        raise InvalidInput(f"{what} must be an even number of hex digits")
    return bytes.fromhex(text)


def _parse_tokens(text: str, source: str) -> list[int]:
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values: Any = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{source}: not a JSON array of integers: {exc}") from None
        if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            raise InvalidInput(f"{source}: not a JSON array of integers")
        return values
    tokens = []
    for item in re.split(r"[\s,]+", stripped) if stripped else []:
        if re.fullmatch(r"[0-9]+", item) is None:
            raise InvalidInput(f"{source}: {item!r} is not a non-negative integer token id")
        tokens.append(int(item))
    return tokens


def _descriptor(path: Path | None) -> CompatibilityDescriptor | None:
    return None if path is None else CompatibilityDescriptor.parse(_read_bytes(path, "descriptor"))


@app.command("compat-id")
def compat_id_command(
    descriptor: Annotated[Path, typer.Argument(help="Compatibility Descriptor (JSON)")],
) -> None:
    """Print the Compatibility ID (hex32) of a descriptor."""
    parsed = CompatibilityDescriptor.parse(_read_bytes(descriptor, "descriptor"))
    typer.echo(parsed.compat_id().hex())


@app.command("scope-id")
def scope_id_command(
    scope_key: Annotated[str, typer.Option("--scope-key", help="scope key, hex (>= 32 octets)")],
) -> None:
    """Print the Scope ID (hex16) of a scope key."""
    typer.echo(scope_id(_hex_octets(scope_key, "--scope-key")).hex())


@app.command("block-keys")
def block_keys_command(
    scope_key: Annotated[str, typer.Option("--scope-key", help="scope key, hex")],
    compat_id: Annotated[str, typer.Option("--compat-id", help="Compatibility ID, hex32")],
    block_tokens: Annotated[int, typer.Option("--block-tokens", min=1, help="block size B")],
    tokens: Annotated[
        str | None, typer.Option("--tokens", help="comma-separated token ids")
    ] = None,
    tokens_file: Annotated[
        Path | None,
        typer.Option("--tokens-file", help="token ids: JSON array, or separated by commas/space"),
    ] = None,
    parent: Annotated[
        str | None,
        typer.Option("--parent", help="last Block Key of a shared-scope prefix to chain on"),
    ] = None,
) -> None:
    """Print one Block Key (hex32) per complete block, in prefix order."""
    if tokens is not None and tokens_file is None:
        ids = _parse_tokens(tokens, "--tokens")
    elif tokens_file is not None and tokens is None:
        text = _read_bytes(tokens_file, "tokens file").decode("utf-8", "replace")
        ids = _parse_tokens(text, str(tokens_file))
    else:
        raise InvalidInput("give exactly one of --tokens and --tokens-file")
    keys = block_keys(
        _hex_octets(scope_key, "--scope-key"),
        parse_compat_id(compat_id),
        ids,
        block_tokens,
        parse_block_key(parent) if parent is not None else ROOT_PARENT,
    )
    sys.stdout.write("".join(k.hex() + "\n" for k in keys))


@container_app.command("build")
def container_build_command(
    first_layer: Annotated[int, typer.Option("--first-layer", min=0)],
    token_count: Annotated[int, typer.Option("--token-count", min=1)],
    out: Annotated[Path, typer.Option("--out", help="container file to write")],
    sections: Annotated[list[Path], typer.Argument(help="K/V section files: K0 V0 [K1 V1 ...]")],
    codec: Annotated[int, typer.Option("--codec")] = CODEC_RAW,
    descriptor: Annotated[
        Path | None,
        typer.Option("--descriptor", help="check section sizes against this descriptor"),
    ] = None,
) -> None:
    """Write a KVB1 container from per-layer K and V section files."""
    if not sections or len(sections) % 2:
        raise InvalidInput("sections come in K V pairs, one pair per layer")
    data = [_read_bytes(p, "section") for p in sections]
    parsed = _descriptor(descriptor)
    built = Container.build(
        first_layer,
        token_count,
        list(zip(data[0::2], data[1::2], strict=True)),
        codec=codec,
        geometry=parsed.geometry if parsed else None,
    )
    try:
        with out.open("wb") as f:
            f.writelines(built.parts)
    except OSError as exc:
        raise InvalidInput(f"cannot write {out}: {exc.strerror}") from None


@container_app.command("inspect")
def container_inspect_command(
    file: Annotated[Path, typer.Argument(help="container file")],
    descriptor: Annotated[
        Path | None,
        typer.Option("--descriptor", help="check section sizes against this descriptor"),
    ] = None,
) -> None:
    """Validate a container and print its header, layer digests and replica digest as JSON."""
    parsed = _descriptor(descriptor)
    container = Container.parse(_read_bytes(file, "container"), parsed.geometry if parsed else None)
    header = container.header
    digests = container.layer_digests()
    doc = {
        "version": 1,
        "flags": 0,
        "codec": header.codec,
        "first_layer": header.first_layer,
        "layer_count": header.layer_count,
        "token_count": header.token_count,
        "layers": [
            {
                "layer": layer.layer,
                "k_length": len(layer.k),
                "v_length": len(layer.v),
                "digest": d.hex(),
            }
            for layer, d in zip(container.layers, digests, strict=True)
        ],
        "digest": container.digest().hex(),
    }
    typer.echo(json.dumps(doc, indent=2))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _principals(auth: Path | None, host: str) -> Principals:
    """The principals file, or development mode, which only ever binds to loopback."""
    if auth is not None:
        return Principals.load(auth)
    if not _is_loopback(host):
        raise InvalidInput("without --auth a service binds to loopback only")
    return Principals.development_mode()


#: the front door's limits, one ``--http-limit NAME=VALUE`` each (every service takes them)
#: the tenants' quotas by Scope ID, for holders and the Index Service
QuotasFile = Annotated[
    Path | None, typer.Option("--quotas", help="per-scope quotas (kvsp tenants quotas)")
]


HttpLimits = Annotated[
    list[str] | None,
    typer.Option(
        "--http-limit",
        help="front door limit NAME=VALUE, repeatable: head_octets, header_fields, "
        "target_octets, head_timeout_s, body_idle_s, idle_timeout_s, connections",
    ),
]


LogFormat = Annotated[
    str,
    typer.Option(
        "--log-format",
        help="text (one line each) or json (one object per line, with request and trace ids)",
    ),
]


def _serve(
    asgi_app: Any,
    principals: Principals,
    service: str,
    host: str,
    port: int,
    log_level: str,
    log_format: str,
    http_limits: list[str] | None,
) -> None:
    """Run a service's ASGI app behind its front door until it is stopped."""
    from kvsp.web.serving import configure_logs, parse_front_door, serve

    configure_logs(log_level, log_format, service)  # a wrong format is refused before serving
    if principals.development:
        logging.getLogger("kvsp.auth").warning(
            "development mode (no --auth): every request is allowed"
        )
    try:
        door = parse_front_door(http_limits or [])
    except ValueError as exc:
        raise InvalidInput(f"--http-limit {exc}") from None
    serve(asgi_app, host, port, log_level, door, service)


@index_app.command("serve")
@settings_command("index")
def index_serve_command(
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 9100,
    store: Annotated[
        str, typer.Option("--store", help="memory, or redis://HOST:PORT/DB to share records")
    ] = "memory",
    auth: Annotated[Path | None, typer.Option("--auth", help="principals file (TOML)")] = None,
    max_ttl_ms: Annotated[int, typer.Option("--max-ttl-ms", min=1)] = 600_000,
    max_records: Annotated[int, typer.Option("--max-records", min=1)] = 5_000_000,
    max_instances: Annotated[int, typer.Option("--max-instances", min=1)] = 65_536,
    descriptors: Annotated[
        Path | None,
        typer.Option(
            "--descriptors", help="JSON file: the Compatibility Descriptors known from the start"
        ),
    ] = None,
    max_descriptors: Annotated[
        int, typer.Option("--max-descriptors", min=1, help="descriptors that may be registered")
    ] = 4096,
    max_scope_records: Annotated[
        int, typer.Option("--max-scope-records", min=1, help="records per scope by default")
    ] = 1_000_000,
    quotas: QuotasFile = None,
    max_layers: Annotated[int, typer.Option("--max-layers", min=1, max=65_535)] = 1024,
    max_body_bytes: Annotated[str, typer.Option("--max-body-bytes")] = "5M",
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: LogFormat = "text",
    http_limit: HttpLimits = None,
) -> None:
    """Run the Index Service on HOST:PORT under /kvsp/."""
    from kvsp.core.clock import SystemClock
    from kvsp.index.app import create_app
    from kvsp.index.rules import IndexLimits
    from kvsp.index.service import IndexService
    from kvsp.index.stores import open_store

    limits = IndexLimits(
        max_ttl_ms=max_ttl_ms,
        max_records=max_records,
        max_instances=max_instances,
        max_descriptors=max_descriptors,
        max_scope_records=max_scope_records,
        quotas=Quotas.load(quotas),
    )
    replica_store = open_store(store, limits, SystemClock())
    principals = _principals(auth, host)
    known = [] if descriptors is None else _descriptors(descriptors)
    service = IndexService(replica_store, max_layers=max_layers, descriptors=known)
    app = create_app(service, principals, parse_octets(max_body_bytes))
    _serve(app, principals, "index", host, port, log_level, log_format, http_limit)


@index_app.command("ingest")
@settings_command("ingest")
def index_ingest_command(
    pods: Annotated[Path, typer.Option("--pods", help="pods file (TOML): the vLLM pods to read")],
    tenants: Annotated[Path, typer.Option("--tenants", help="tenants file (TOML, secret)")],
    index: Annotated[str, typer.Option("--index", help="Index Service base URL")],
    token_file: Annotated[
        Path | None, typer.Option("--token-file", help="an ingest principal's bearer token")
    ] = None,
    block_tokens: Annotated[int, typer.Option("--block-tokens", min=1)] = 16,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: LogFormat = "text",
) -> None:
    """Read the KV events of plain vLLM pods into the IS: each pod's blocks as kvsp Block Keys
    of its tenants' scopes, held at the pod (docs/operations.md)."""
    import asyncio

    from kvsp.kvevents.ingest import ingest, load_pods
    from kvsp.model import installed, system_prefix
    from kvsp.tenants import Tenants
    from kvsp.web.serving import configure_logs, tune_collector

    configure_logs(log_level, log_format, "ingest")
    tune_collector()
    files = installed(None, block_tokens)
    known = Tenants.load(tenants, system_prefix(files))
    descriptor = files.descriptor
    endpoints = load_pods(
        pods, known, files.compat_id.hex(), block_tokens, descriptor.geometry.layers
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(ingest(endpoints, index, _read_token(token_file)))


def _descriptors(path: Path) -> list[CompatibilityDescriptor]:
    """A JSON file of one Compatibility Descriptor or an array of them."""
    try:
        doc = json.loads(_read_bytes(path, "descriptors file"))
    except ValueError as exc:
        raise InvalidInput(f"descriptors file {path} is not JSON: {exc}") from None
    return [CompatibilityDescriptor.parse(d) for d in (doc if isinstance(doc, list) else [doc])]


def _read_token(path: Path | SecretStr | None) -> str | None:
    """A bearer token: from its file, or as the environment gave it (``kvsp.settings``)."""
    if path is None:
        return None
    if isinstance(path, SecretStr):
        return path.get_secret_value()
    token = _read_bytes(path, "token file").decode("utf-8", "replace").strip()
    if not token:
        raise InvalidInput(f"token file {path} is empty")
    return token


@holder_app.command("serve")
@settings_command("holder")
def holder_serve_command(
    url: Annotated[str, typer.Option("--url", help="this holder's base URL, as published")],
    host_bytes: Annotated[str, typer.Option("--host-bytes", help="host memory tier, e.g. 4G")],
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 9101,
    index: Annotated[
        str | None, typer.Option("--index", help="Index Service base URL to publish to")
    ] = None,
    index_token_file: Annotated[
        Path | None, typer.Option("--index-token-file", help="bearer token for the IS")
    ] = None,
    index_routes: Annotated[
        str,
        typer.Option(
            "--index-routes",
            help="auto (the batch extension, else KVSP 6.1's PUT and DELETE), batch or text",
        ),
    ] = "auto",
    auth: Annotated[Path | None, typer.Option("--auth", help="principals file (TOML)")] = None,
    disk_dir: Annotated[Path | None, typer.Option("--disk-dir")] = None,
    disk_bytes: Annotated[str, typer.Option("--disk-bytes")] = "0",
    lease_quota_bytes: Annotated[
        str, typer.Option("--lease-quota-bytes", help="leased octets per scope by default")
    ] = "256M",
    max_leases: Annotated[
        int, typer.Option("--max-leases", min=1, help="valid leases per scope by default")
    ] = 4096,
    quotas: QuotasFile = None,
    lease_max_ttl_ms: Annotated[int, typer.Option("--lease-max-ttl-ms", min=1)] = 60_000,
    record_ttl_ms: Annotated[int, typer.Option("--record-ttl-ms", min=2)] = 600_000,
    max_block_bytes: Annotated[str, typer.Option("--max-block-bytes")] = "256M",
    max_layers: Annotated[int, typer.Option("--max-layers", min=1, max=65_535)] = 1024,
    max_inflight_bytes: Annotated[str, typer.Option("--max-inflight-bytes")] = "1G",
    block_overhead_bytes: Annotated[str, typer.Option("--block-overhead-bytes")] = "2K",
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: LogFormat = "text",
    http_limit: HttpLimits = None,
) -> None:
    """Run a holder on HOST:PORT under /kvsp/, publishing what it holds to --index."""
    from kvsp.holder.app import create_app
    from kvsp.holder.leases import LeaseLimits
    from kvsp.holder.service import HolderConfig, HolderService, parse_index_routes

    config = HolderConfig(
        url=url,
        host_bytes=parse_octets(host_bytes),
        disk_dir=disk_dir,
        disk_bytes=parse_octets(disk_bytes),
        leases=LeaseLimits(
            quota_octets=parse_octets(lease_quota_bytes),
            max_ttl_ms=lease_max_ttl_ms,
            max_leases=max_leases,
        ),
        quotas=Quotas.load(quotas),
        record_ttl_ms=record_ttl_ms,
        max_block_octets=parse_octets(max_block_bytes),
        max_layers=max_layers,
        max_inflight_octets=parse_octets(max_inflight_bytes),
        block_overhead_octets=parse_octets(block_overhead_bytes),
        index_url=index,
        index_token=_read_token(index_token_file),
        index_routes=parse_index_routes(index_routes),
    )
    principals = _principals(auth, host)
    _serve(
        create_app(HolderService(config), principals),
        principals,
        "holder",
        host,
        port,
        log_level,
        log_format,
        http_limit,
    )


@controller_app.command("serve")
@settings_command("controller")
def controller_serve_command(
    tenants: Annotated[Path, typer.Option("--tenants", help="tenants file (TOML, secret)")],
    index: Annotated[str | None, typer.Option("--index", help="Index Service base URL")] = None,
    index_token_file: Annotated[Path | None, typer.Option("--index-token-file")] = None,
    instance_token_file: Annotated[
        Path | None, typer.Option("--instance-token-file", help="token presented to instances")
    ] = None,
    auth: Annotated[Path | None, typer.Option("--auth", help="principals file (TOML)")] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 9000,
    block_tokens: Annotated[int, typer.Option("--block-tokens", min=1)] = 16,
    min_active: Annotated[int, typer.Option("--min-active", min=0)] = 1,
    max_epoch_ahead_ms: Annotated[int, typer.Option("--max-epoch-ahead-ms", min=0)] = 86_400_000,
    max_cost_us: Annotated[float, typer.Option("--max-cost-us", min=0)] = float("inf"),
    mean_service_us: Annotated[float, typer.Option("--mean-service-us", min=0)] = 500_000.0,
    frontend: Annotated[
        bool, typer.Option("--frontend", help="serve v1/completions for the installed model")
    ] = False,
    state: Annotated[
        str,
        typer.Option("--state", help="memory, or a redis:// URL shared by several controllers"),
    ] = "memory",
    url: Annotated[
        str | None,
        typer.Option("--url", help="this controller's base URL (default: from host and port)"),
    ] = None,
    lease_ms: Annotated[
        int, typer.Option("--lease-ms", min=100, help="the leader's lease (Redis state)")
    ] = 1_500,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: LogFormat = "text",
    http_limit: HttpLimits = None,
) -> None:
    """Run the Placement Controller on HOST:PORT under /kvsp/."""
    from kvsp.controller.app import BODY_OCTETS, create_app
    from kvsp.controller.instances import InstancePolicy
    from kvsp.controller.placement import PlacementPolicy
    from kvsp.controller.service import ControllerConfig, ControllerService
    from kvsp.model import installed, system_prefix, text_tokenizer
    from kvsp.tenants import Tenants

    def tokenize(text: str) -> list[int]:  # the model is needed only for a prefix_system
        return system_prefix(installed(None, block_tokens))(text)

    config = ControllerConfig(
        tenants=Tenants.load(tenants, tokenize),
        index_url=index,
        index_token=_read_token(index_token_file),
        instance_token=_read_token(instance_token_file),
        block_tokens=block_tokens,
        placement=PlacementPolicy(max_cost_us=max_cost_us, mean_service_us=mean_service_us),
        instances=InstancePolicy(min_active=min_active, max_epoch_ahead_ms=max_epoch_ahead_ms),
        state=state,
        url=url or f"http://{host}:{port}/kvsp/",
        lease_ms=lease_ms,
    )
    principals = _principals(auth, host)
    service = ControllerService(config)
    more: list[Op] = []
    closing: list[Callable[[], Awaitable[None]]] = []
    if frontend:
        from kvsp.frontend.app import frontend_ops
        from kvsp.frontend.controllers import InProcessController
        from kvsp.frontend.metrics import FrontEndMetrics
        from kvsp.frontend.service import load_frontend
        from kvsp.model import installed

        files = installed(None, block_tokens)
        local = InProcessController(service)
        metrics = FrontEndMetrics(service.metrics.registry)
        front = load_frontend(local, config.tenants, files, config.instance_token, metrics)
        more, closing = frontend_ops(front, BODY_OCTETS), [front.aclose]
    query_text = text_tokenizer(lambda: installed(None, block_tokens))
    app = create_app(service, principals, more, closing, query_text)
    _serve(app, principals, "controller", host, port, log_level, log_format, http_limit)


@frontend_app.command("serve")
@settings_command("frontend")
def frontend_serve_command(
    tenants: Annotated[Path, typer.Option("--tenants", help="tenants file (TOML, secret)")],
    controller: Annotated[
        list[str], typer.Option("--controller", help="a controller's base URL (repeatable)")
    ],
    token_file: Annotated[
        Path | None,
        typer.Option("--token-file", help="the front end's token for controllers and instances"),
    ] = None,
    auth: Annotated[
        Path | None,
        typer.Option("--auth", help="principals file: who may read GET metrics (role metrics)"),
    ] = None,
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 9080,
    block_tokens: Annotated[int, typer.Option("--block-tokens", min=1)] = 16,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: LogFormat = "text",
    http_limit: HttpLimits = None,
) -> None:
    """Run the OpenAI-compatible front end on HOST:PORT under /kvsp/v1/, placing requests with
    whichever of the controllers leads (a controller's death does not cut a stream)."""
    from kvsp.frontend.app import create_app
    from kvsp.frontend.controllers import RemoteController
    from kvsp.frontend.service import load_frontend
    from kvsp.model import installed, system_prefix
    from kvsp.tenants import Tenants

    token = _read_token(token_file)
    files = installed(None, block_tokens)
    parsed = Tenants.load(tenants, system_prefix(files))
    principals = _principals(auth, host)
    controllers = RemoteController(controller, token)
    app = create_app(load_frontend(controllers, parsed, files, token), controllers, principals)
    _serve(app, principals, "frontend", host, port, log_level, log_format, http_limit)


@model_app.command("install")
def model_install_command(
    home: Annotated[
        Path | None, typer.Option("--home", help="models folder (default: $KVSP_HOME/models)")
    ] = None,
) -> None:
    """Fetch and prepare the default model once; prints its folder and Compatibility ID."""
    from kvsp.model import install

    files = install(home)
    typer.echo(json.dumps({"folder": str(files.folder), "compat_id": files.compat_id.hex()}))


@instance_app.command("serve")
@settings_command("instance")
def instance_serve_command(
    url: Annotated[str, typer.Option("--url", help="this instance's base URL, as published")],
    tenants: Annotated[Path, typer.Option("--tenants", help="tenants file (TOML, secret)")],
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535)] = 9201,
    controller: Annotated[str | None, typer.Option("--controller")] = None,
    index: Annotated[str | None, typer.Option("--index")] = None,
    token_file: Annotated[
        Path | None, typer.Option("--token-file", help="this instance's bearer token")
    ] = None,
    offload: Annotated[
        str | None, typer.Option("--offload", help="a holder that keeps a copy of every block")
    ] = None,
    auth: Annotated[Path | None, typer.Option("--auth", help="principals file (TOML)")] = None,
    g1_blocks: Annotated[
        int, typer.Option("--g1-blocks", min=1, help="G1 capacity in blocks (KV pages)")
    ] = 256,
    g1_layers: Annotated[
        int | None,
        typer.Option("--g1-layers", min=1, help="leading layers of a block kept in G1"),
    ] = None,
    g2_bytes: Annotated[str, typer.Option("--g2-bytes")] = "1G",
    block_tokens: Annotated[int, typer.Option("--block-tokens", min=1)] = 16,
    status_ttl_ms: Annotated[int, typer.Option("--status-ttl-ms", min=300)] = 3_000,
    record_ttl_ms: Annotated[
        int, typer.Option("--record-ttl-ms", min=2, help="TTL of the pool's Replica Records")
    ] = 600_000,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, help="output tokens one request may ask for")
    ] = 256,
    prefill_chunk: Annotated[
        int, typer.Option("--prefill-chunk", min=1, help="prompt tokens per engine turn")
    ] = 512,
    threads: Annotated[int | None, typer.Option("--threads", min=1)] = None,
    sleep_after_s: Annotated[
        float | None, typer.Option("--sleep-after-s", help="ask to sleep when idle this long")
    ] = None,
    session_index: Annotated[
        bool, typer.Option("--session-index", help="keep the SessionPrefixIndex (KvHints)")
    ] = False,
    max_pin_ms: Annotated[int, typer.Option("--max-pin-ms", min=1)] = 300_000,
    pin_session_bytes: Annotated[str, typer.Option("--pin-session-bytes")] = "64M",
    pin_total_bytes: Annotated[str, typer.Option("--pin-total-bytes")] = "256M",
    engine: Annotated[
        str, typer.Option("--engine", help="transformers (reference) or vllm (kvsp[vllm])")
    ] = "transformers",
    vllm_page_tokens: Annotated[
        int, typer.Option("--vllm-page-tokens", min=16, help="tokens per vLLM KV page")
    ] = 128,
    vllm_kv_cache_gib: Annotated[
        int, typer.Option("--vllm-kv-cache-gib", min=1, help="vLLM's KV cache size")
    ] = 1,
    vllm_pages: Annotated[
        int | None,
        typer.Option("--vllm-pages", min=2, help="vLLM's KV pages (default: what fits the size)"),
    ] = None,
    vllm_local_reads: Annotated[
        bool,
        typer.Option(
            "--vllm-local-reads/--no-vllm-local-reads",
            help="vLLM's connector reads this instance's own holder in process",
        ),
    ] = True,
    kv_events: Annotated[
        str | None,
        typer.Option(
            "--kv-events",
            help="publish vLLM-format KV events on this ZMQ endpoint (tcp://127.0.0.1:5557)",
        ),
    ] = None,
    kv_events_replay: Annotated[
        str | None,
        typer.Option("--kv-events-replay", help="the ZMQ ROUTER endpoint for replays"),
    ] = None,
    kv_events_topic: Annotated[str, typer.Option("--kv-events-topic")] = "",
    kv_events_buffer: Annotated[
        int, typer.Option("--kv-events-buffer", min=1, help="batches kept for replay")
    ] = 10_000,
    kv_events_heartbeat_s: Annotated[
        float, typer.Option("--kv-events-heartbeat-s", min=0, help="idle heartbeat (0: none)")
    ] = 1.0,
    kv_events_curve_key_file: Annotated[
        Path | None,
        typer.Option("--kv-events-curve-key-file", help="Z85 CURVE server secret key"),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level")] = "info",
    log_format: LogFormat = "text",
    http_limit: HttpLimits = None,
) -> None:
    """Run an inference instance on HOST:PORT under /kvsp/ (install the model first)."""
    if engine not in ("transformers", "vllm"):
        _fail(f"--engine must be transformers or vllm, not {engine!r}")
    from kvsp.instance.app import create_app
    from kvsp.instance.config import InstanceConfig
    from kvsp.instance.hints import HintLimits
    from kvsp.instance.service import InstanceService
    from kvsp.kvevents.publisher import PublisherConfig
    from kvsp.model import installed, system_prefix
    from kvsp.tenants import Tenants

    events = None
    if kv_events is not None:
        events = PublisherConfig(
            endpoint=kv_events,
            replay_endpoint=kv_events_replay,
            topic=kv_events_topic,
            buffer_batches=kv_events_buffer,
            heartbeat_s=kv_events_heartbeat_s,
            curve_secret_key=_read_token(kv_events_curve_key_file),
        )
    config = InstanceConfig(
        url=url,
        tenants=Tenants.load(tenants, system_prefix(installed(None, block_tokens))),
        g2_bytes=parse_octets(g2_bytes),
        g1_blocks=g1_blocks,
        g1_layers=g1_layers,
        block_tokens=block_tokens,
        controller_url=controller,
        index_url=index,
        token=_read_token(token_file),
        offload_url=offload,
        status_ttl_ms=status_ttl_ms,
        record_ttl_ms=record_ttl_ms,
        max_tokens=max_tokens,
        prefill_chunk=prefill_chunk,
        threads=threads,
        sleep_after_s=sleep_after_s,
        session_index=session_index,
        hint_limits=HintLimits(
            max_pin_ms=max_pin_ms,
            pin_session_bytes=parse_octets(pin_session_bytes),
            pin_total_bytes=parse_octets(pin_total_bytes),
        ),
        kv_events=events,
    )
    principals = _principals(auth, host)
    if engine == "vllm":
        from kvsp.integrations.vllm.instance import VllmInstanceService, VllmOptions

        options = VllmOptions(
            tenants, vllm_page_tokens, vllm_kv_cache_gib, vllm_pages, vllm_local_reads
        )
        service: InstanceService = VllmInstanceService(config, options)
    else:
        service = InstanceService(config)
    _serve(
        create_app(service, principals),
        principals,
        "instance",
        host,
        port,
        log_level,
        log_format,
        http_limit,
    )


@app.command("up")
def up_command(
    instances: Annotated[int, typer.Option("--instances", min=1, max=16)] = 2,
    port: Annotated[
        int | None, typer.Option("--port", min=1, max=65535, help="the controller's port")
    ] = None,
    folder: Annotated[
        Path | None, typer.Option("--dir", help="where files and logs go (default: a new one)")
    ] = None,
    g1_blocks: Annotated[int, typer.Option("--g1-blocks", min=1)] = 256,
    g2_bytes: Annotated[str, typer.Option("--g2-bytes")] = "1G",
    controllers: Annotated[
        int,
        typer.Option(
            "--controllers",
            min=1,
            max=8,
            help="controllers sharing one state in a local redis-server (one leads)",
        ),
    ] = 1,
) -> None:
    """Run an Index Service, a controller with the OpenAI-compatible front end, a holder and
    INSTANCES inference instances on loopback until Ctrl-C (install the model first). With
    --controllers N, N controllers share their state in a redis-server that kvsp up starts
    and stops, and the front end runs on its own before them."""
    import tempfile

    from kvsp.local import LocalCluster

    where = folder or Path(tempfile.mkdtemp(prefix="kvsp-up-"))
    cluster = LocalCluster(
        where, instances, port, controllers, g1_blocks=g1_blocks, g2_bytes=g2_bytes
    )
    # stop cleanly on SIGTERM too, and on Ctrl-C even when started with SIGINT ignored (as a
    # shell's background job is)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    try:
        cluster.start()
        _announce(cluster)
        while True:
            time.sleep(1.0)
            sys.stdout.write("\r" + _status_line(cluster) + " " * 8)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write("\nstopping...\n")
    finally:
        cluster.stop()
    sys.stdout.write("stopped: no kvsp process left\n")


@app.command("demo")
def demo_command(
    folder: Annotated[
        Path | None, typer.Option("--dir", help="where files and logs go (default: a new one)")
    ] = None,
) -> None:
    """Bring up a cluster on this machine and show what kvsp does: cached prefixes local and
    remote, a tool gap kept by hints, an instance killed mid-generation. Exit 0 only if every
    check held."""
    import tempfile

    from kvsp.demo import run_demo
    from kvsp.model import install

    install()
    where = folder or Path(tempfile.mkdtemp(prefix="kvsp-demo-"))
    if not run_demo(where):
        raise SystemExit(1)


@app.command("sim")
def sim_command(
    scenario: Annotated[
        str, typer.Option(help="a scenario file (TOML) or a shipped scenario's name")
    ] = DEFAULT_SCENARIO,
    trace: Annotated[
        Path | None, typer.Option(help="a Mooncake trace (JSON lines) to replay")
    ] = None,
    workload: Annotated[
        str, typer.Option(help="trace, agentic or shared-prefix (generated)")
    ] = "trace",
    policy: Annotated[str, typer.Option(help="'all' or policies separated by commas")] = "all",
    out: Annotated[Path, typer.Option(help="where the report and plots go")] = Path("sim-out"),
    copies: Annotated[
        int, typer.Option(help="the workload this many times over, one tenant each")
    ] = 1,
    rate_scale: Annotated[float, typer.Option(help="arrivals this many times faster")] = 1.0,
    requests: Annotated[int | None, typer.Option(help="only the first N requests")] = None,
    sweep: Annotated[
        bool, typer.Option(help="also sweep cache size and request rate (more runs)")
    ] = False,
    jobs: Annotated[int | None, typer.Option(help="runs at a time (default: CPUs)")] = None,
) -> None:
    """Simulate a cluster in virtual time over kvsp's real placement, index and pool code, and
    compare placement policies on one workload."""
    from kvsp.sim.command import simulate
    from kvsp.sim.policies import POLICIES
    from kvsp.sim.runner import WorkloadSpec
    from kvsp.sim.scenario import load_scenario

    chosen = list(POLICIES) if policy == "all" else [p.strip() for p in policy.split(",")]
    unknown = sorted(set(chosen) - set(POLICIES))
    if unknown:
        raise typer.BadParameter(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if workload == "trace" and trace is None:
        raise typer.BadParameter("--trace is needed for --workload trace")
    spec = WorkloadSpec(workload, str(trace) if trace else None, copies, rate_scale, requests)
    simulate(load_scenario(scenario), spec, chosen, out, sweep, jobs)


def _announce(cluster: LocalCluster) -> None:
    info = cluster.describe()
    base = info["openai_base_url"]
    lines = [
        "kvsp is up",
        f"  OpenAI base URL  {base}",
        f"  cluster page     {cluster.cluster_page}",
        *(f"  API key          {key}  (tenant {name})" for name, key in cluster.api_keys.items()),
        *(f"  controller       {p.url}" for p in cluster.controller_processes),
        f"  operator token   {info['operator_token']}",
        f"  metrics token    {cluster.metrics_token}  (GET metrics on every service)",
        f"  router token     {cluster.router_token}  (POST query on the controller)",
        f"  Index Service    {info['index']}",
        f"  holder           {info['holder']}",
        *(
            f"  instance         {p.url}" + (f"  KV events {e} replay {r}" if e else "")
            for p, (e, r) in zip(
                cluster.instance_processes,
                cluster.kv_event_endpoints or [("", "")] * len(cluster.instance_processes),
                strict=True,
            )
        ),
        f"  files and logs   {cluster.folder}",
        "try:",
        f"  curl -s {base}/completions -H 'Authorization: Bearer {info['api_key']}' \\",
        "    -H 'Content-Type: application/json' \\",
        '    -d \'{"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}\'',
        "Ctrl-C stops everything.",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _status_line(cluster: LocalCluster) -> str:
    try:
        view = cluster.view()
    except Exception as exc:
        return f"controller unreachable: {exc}"
    parts = [
        f"{str(i['instance']).split(':')[-1].split('/')[0]} {i['state']} "
        f"running {i['running']} kv {float(str(i['kv_utilization'])):.0%}"
        for i in view
    ]
    return time.strftime("%H:%M:%S ") + " | ".join(parts)


def _fail(message: str) -> NoReturn:
    sys.stderr.write(f"kvsp: error: {' '.join(message.split())}\n")
    raise SystemExit(USAGE_ERROR)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``kvsp`` console script."""
    try:
        code = app(args=argv, prog_name="kvsp", standalone_mode=False)
    except NoArgsIsHelpError as exc:
        sys.stderr.write(exc.ctx.get_help() + "\n" if exc.ctx else "")
        raise SystemExit(USAGE_ERROR) from None
    except ClickException as exc:
        _fail(exc.format_message())
    except KvspError as exc:
        _fail(exc.detail)
    except typer.Abort:
        raise SystemExit(130) from None
    raise SystemExit(code if isinstance(code, int) else 0)
