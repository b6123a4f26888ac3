"""Each service's routes, served and described by one table: ``Op`` rows become Starlette
routes and an OpenAPI 3.1 document (``GET {base}openapi.json``) whose schemas come from the
pydantic records the routes already parse, so the description cannot drift from the code.

Every operation also answers problem documents (RFC 9457), described once as the ``default``
response; a test runs schemathesis against each service started as a real process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, request_response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvsp.auth import Principal, Principals, Role, authorize
from kvsp.core.registries import JSON_MEDIA_TYPE, PROBLEM_MEDIA_TYPE
from kvsp.web.server import AsgiEndpoint, header_value

__all__ = [
    "ANYONE",
    "HEALTH",
    "METRICS_ROLES",
    "PATH_PARAMETERS",
    "PROBLEM_SCHEMA",
    "Body",
    "Op",
    "access_rows",
    "obj",
    "openapi_document",
    "principal_of",
    "routes_of",
]

#: a body: a record model, a JSON schema, or a media type whose octets are not JSON
Body = type[BaseModel] | dict[str, Any] | str | None

PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer", "minimum": 400, "maximum": 599},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
    },
}

#: what ``GET healthz`` answers on every service
HEALTH: dict[str, Any] = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"type": "string"}},
}

_PARAMETER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_HEX32 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
_HEX16 = {"type": "string", "pattern": "^[0-9a-f]{32}$"}
_UUID = {"type": "string", "format": "uuid"}
#: path parameters by name, the same in every service
PATH_PARAMETERS: dict[str, dict[str, Any]] = {
    "compat": _HEX32,
    "scope": _HEX16,
    "block_key": _HEX32,
    "session": _UUID,
    "directive": _UUID,
    "decision": _UUID,
}


def obj(required: Sequence[str] = (), **properties: dict[str, Any]) -> dict[str, Any]:
    """A JSON object schema, for bodies that have no record model."""
    return {"type": "object", "required": list(required), "properties": properties}


#: the roles of a route anyone may call, with no token
ANYONE: tuple[Role, ...] = ()
#: ``GET metrics`` names scopes and principals: a scraper's token (role metrics) or an admin's
METRICS_ROLES = (Role.METRICS,)
_PRINCIPAL = "kvsp.principal"


@dataclass(frozen=True)
class Op:
    """One route: where, what it takes and answers, and who may call it.

    ``roles`` is checked before the endpoint runs, so a caller without one of them learns
    nothing about what the route holds (no lookup, no validation of its input has happened);
    a ``{scope}`` in the path is checked there too. ``scope`` says, for the access table in
    docs/api.md, which scope the endpoint checks itself ("" for none).
    """

    method: str
    path: str
    endpoint: Any
    summary: str
    roles: tuple[Role, ...]
    scope: str = ""
    body: Body = None
    #: status -> what that answer carries
    answers: dict[int, Body] = field(default_factory=lambda: {200: None})
    #: query parameters (name -> schema)
    query: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the caller is a tenant's API key (the OpenAI front end), which the endpoint checks
    api_key: bool = False

    @property
    def who(self) -> str:
        if self.api_key:
            return f"a tenant's API key (Authorization: Bearer), for {self.scope}"
        if not self.roles:
            return "anyone"
        names = " or ".join(r.value for r in self.roles)
        return f"role {names}" + (f", in {self.scope}" if self.scope else "")


def principal_of(scope: Scope) -> Principal:
    """The principal ``routes_of`` authenticated for the request of ``scope``."""
    principal: Principal = scope[_PRINCIPAL]
    return principal


class _Guarded:
    """An endpoint behind its roles: the token is authenticated, the roles (and a ``{scope}``
    of the path) authorized, before the endpoint sees the request."""

    def __init__(self, op: Op, principals: Principals) -> None:
        endpoint = self.endpoint = op.endpoint
        self._app: ASGIApp = (
            endpoint if isinstance(endpoint, AsgiEndpoint) else request_response(endpoint)
        )
        self._roles = op.roles
        self._principals = principals

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._roles:
            principal = self._principals.authenticate(header_value(scope, b"authorization"))
            authorize(principal, self._roles, scope=scope.get("path_params", {}).get("scope"))
            scope[_PRINCIPAL] = principal
        await self._app(scope, receive, send)


def routes_of(base: str, title: str, ops: Sequence[Op], principals: Principals) -> list[Route]:
    """Starlette routes for ``ops``, each behind its roles, and ``GET {base}openapi.json``
    describing them."""
    text: list[bytes] = []

    async def openapi(_: Request) -> Response:
        if not text:
            text.append(json.dumps(openapi_document(title, base, ops)).encode())
        return Response(text[0], media_type="application/json")

    described = [
        *ops,
        Op("GET", "openapi.json", openapi, "this document", ANYONE,
           answers={200: {"type": "object"}}),
    ]  # fmt: skip
    return [
        Route(base + op.path, _Guarded(op, principals), methods=[op.method]) for op in described
    ]


def access_rows(document: dict[str, Any]) -> list[str]:
    """The access table's rows (markdown) of a service's OpenAPI document: route, who may call
    it, and the scope checked (docs/api.md carries them; a test compares)."""
    rows = []
    for path, operations in document["paths"].items():
        for method, op in operations.items():
            callers = ", ".join(op["x-kvsp-roles"]) or "anyone"
            if op["x-kvsp-api-key"]:
                callers = "a tenant's API key"
            rows.append(f"| `{method.upper()} {path}` | {callers} | {op['x-kvsp-scope'] or '-'} |")
    return rows


def _content(body: Body, models: dict[type[BaseModel], str]) -> dict[str, Any] | None:
    if body is None:
        return None
    if isinstance(body, str):
        return {body: {"schema": {"type": "string", "format": "binary"}}}
    if isinstance(body, dict):
        return {JSON_MEDIA_TYPE: {"schema": body}, "application/json": {"schema": body}}
    ref = {"$ref": f"#/components/schemas/{models[body]}"}
    return {JSON_MEDIA_TYPE: {"schema": ref}, "application/json": {"schema": ref}}


def openapi_document(title: str, base: str, ops: Sequence[Op]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``ops`` served under ``base``."""
    used = {
        b
        for op in ops
        for b in (op.body, *op.answers.values())
        if isinstance(b, type) and issubclass(b, BaseModel)
    }
    names, schemas = models_json_schema(
        [(m, "validation") for m in sorted(used, key=lambda m: m.__name__)],
        ref_template="#/components/schemas/{model}",
    )
    models = {m: names[(m, "validation")]["$ref"].rsplit("/", 1)[1] for m in used}
    components = {**schemas.get("$defs", {}), "Problem": PROBLEM_SCHEMA}
    paths: dict[str, dict[str, Any]] = {}
    for op in ops:
        parameters = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": PATH_PARAMETERS.get(name, {"type": "string", "minLength": 1}),
            }
            for name in _PARAMETER.findall(op.path)
        ] + [
            {"name": name, "in": "query", "required": False, "schema": schema}
            for name, schema in op.query.items()
        ]
        responses: dict[str, Any] = {}
        for status, answer in op.answers.items():
            responses[str(status)] = {"description": f"{status}"}
            content = _content(answer, models)
            if content is not None:
                responses[str(status)]["content"] = content
        responses["default"] = {
            "description": "a problem document (RFC 9457)",
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
        operation: dict[str, Any] = {
            "summary": op.summary,
            "description": f"Who may call it: {op.who}.",
            "parameters": parameters,
            "responses": responses,
            # who may call it, for machines: the roles checked before the endpoint runs
            "x-kvsp-roles": [r.value for r in op.roles],
            "x-kvsp-scope": op.scope,
            "x-kvsp-api-key": op.api_key,
        }
        if not op.roles:
            operation["security"] = []  # no token asked for (an API key is the endpoint's)
        request = _content(op.body, models)
        if request is not None:
            operation["requestBody"] = {"required": True, "content": request}
        paths.setdefault(base + op.path, {})[op.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
