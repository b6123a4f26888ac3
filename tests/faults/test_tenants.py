"""Tenants against a ``kvsp up`` cluster in real processes, tried as an outsider would:

- an authorization matrix: every route of every service x every token ``kvsp up`` makes (and a
  client of each tenant) x its own and another tenant's scope x no token and an unknown one; each
  answer must be what the route's roles (its OpenAPI ``x-kvsp-roles``) and scope say, and a
  caller without the role learns nothing (403 before any input is read);
- the poisoning and snooping of the findings, refused: the holder's token cannot store a block
  into an instance, read its events, a session's tokens, its blocks or its shard KV;
- metrics need a scraper's token; every file ``kvsp up`` writes is its owner's only;
- sessions are the tenant's: two tenants may use one name, ids of other tenants answer as
  unknown ones do.
"""

from __future__ import annotations

import itertools
import json
import re
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.auth import token_sha256
from kvsp.core.ids import tenant_session
from kvsp.local import LocalCluster
from kvsp.model import ModelFiles
from kvsp.web.openapi import access_rows
from tests.holder.factories import container

pytestmark = pytest.mark.slow

#: path parameters that are not scopes: anything well formed
FILLERS = {
    "block_key": "ab" * 32,
    "session": "00000000-0000-4000-8000-000000000001",
    "directive": "00000000-0000-4000-8000-000000000002",
    "decision": "00000000-0000-4000-8000-000000000003",
    "map": "m",
    "lease": "nolease",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_files: ModelFiles) -> Iterator[Any]:
    folder = tmp_path_factory.mktemp("isolation")
    up = LocalCluster(folder / "cluster", instances=1, g1_blocks=64, g2_bytes="64M")
    up.prepare()
    # a client principal of each tenant (role client, its own scope only), beside kvsp up's
    with (up.folder / "principals.toml").open("a") as extra:
        for name, scope in up.scope_ids.items():
            extra.write(
                f'\n[principals."client-{name}"]\ntoken_sha256 = "{token_sha256("c-" + name)}"\n'
                f'roles = ["client"]\nholders = []\nscopes = ["{scope}"]\n'
            )
    up.start()
    try:
        yield up
    finally:
        up.stop()


def tokens(up: LocalCluster) -> dict[str, tuple[str | None, frozenset[str]]]:
    """Every caller: its bearer token, and the roles it has (admin passes every role check)."""
    read = lambda name: (up.folder / name).read_text().strip()  # noqa: E731
    return {
        "operator": (up.operator_token, frozenset({"admin"})),
        "controller": (read("controller.token"), frozenset({"controller"})),
        "holder": (read("holder.token"), frozenset({"holder"})),
        "instance": (read("instance-0.token"), frozenset({"instance"})),
        "metrics": (up.metrics_token, frozenset({"metrics"})),
        "client-demo": ("c-demo", frozenset({"client"})),
        "no token": (None, frozenset()),
        "unknown token": ("not-a-token", frozenset()),
    }


def _request(http: httpx.Client, method: str, url: str, token: str | None) -> httpx.Response:
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    body = b"{}" if method in ("POST", "PUT") else None
    return http.request(method, url, content=body, headers={
        **headers, "content-type": "application/json"})  # fmt: skip


def test_every_route_answers_each_token_as_its_roles_and_scope_say(cluster: Any) -> None:
    up: LocalCluster = cluster
    services = {
        "index": up.index.url, "holder": up.holder.url, "controller": up.controller.url,
        "instance": up.instance_processes[0].url,
    }  # fmt: skip
    own, other = up.scope_ids["demo"], up.scope_ids["other"]
    callers = tokens(up)
    checked, mismatches = 0, []
    with httpx.Client(timeout=30) as http:
        for service, base in services.items():
            doc = http.get(base + "openapi.json").json()
            for template, operations in doc["paths"].items():
                for method, op in operations.items():
                    if op["x-kvsp-api-key"]:  # the front end: a tenant's API key, nothing else
                        url = httpx.URL(base).join(template)
                        for caller, token in [
                            *((c, t) for c, (t, _) in callers.items()),
                            *up.api_keys.items(),
                        ]:
                            status = _request(http, method.upper(), str(url), token).status_code
                            checked += 1
                            if (status == 401) == (caller in up.api_keys):
                                mismatches.append((service, method, template, caller, "", status))
                        continue
                    roles = set(op["x-kvsp-roles"])
                    scoped = "{scope}" in template
                    for (caller, (token, has)), scope in itertools.product(
                        callers.items(), (own, other) if scoped else (own,)
                    ):
                        path = template.replace("{scope}", scope)
                        path = path.replace("{compat}", up.compat_id)
                        for name, value in FILLERS.items():
                            path = path.replace("{" + name + "}", value)
                        url = httpx.URL(base).join(path)
                        status = _request(http, method.upper(), str(url), token).status_code
                        checked += 1
                        if not roles:
                            ok = status not in (401, 403)
                        elif token is None or caller == "unknown token":
                            ok = status == 401
                        elif not (has & (roles | {"admin"})) or (
                            scoped and caller.startswith("client-") and scope == other
                        ):
                            ok = status == 403
                        else:
                            ok = status not in (401, 403)
                        if not ok:
                            mismatches.append((service, method, template, caller, scope, status))
    print(f"authorization matrix: {checked} requests, {len(mismatches)} mismatches")
    assert checked > 400
    assert mismatches == []


def test_docs_api_lists_every_route_with_who_may_call_it(cluster: Any) -> None:
    """docs/api.md's access table is the one the running services enforce."""
    up: LocalCluster = cluster
    documented = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    with httpx.Client(timeout=10) as http:
        for process in [up.index, up.holder, up.controller, up.instance_processes[0]]:
            rows = access_rows(http.get(process.url + "openapi.json").json())
            missing = [row for row in rows if row not in documented]
            assert missing == [], f"{process.name}: {missing}"


def _post(http: httpx.Client, url: str, key: str, **body: Any) -> httpx.Response:
    return http.post(url, json=body, headers={"authorization": f"Bearer {key}"})


def test_the_holders_token_can_neither_poison_nor_snoop(cluster: Any) -> None:
    up: LocalCluster = cluster
    holder = (up.folder / "holder.token").read_text().strip()
    instance = up.instance_processes[0].url
    auth = {"authorization": f"Bearer {holder}"}
    base = up.controller.url + "v1/"
    compat = up.compat_id
    with httpx.Client(timeout=120) as http:
        answer = _post(
            http, base + "completions", up.api_keys["other"], prompt="The capital of France is",
            max_tokens=4, temperature=0, session="snooped",
        ).json()  # fmt: skip
        session = answer["kvsp"]["session"]
        scope = up.scope_ids["other"]
        key = "cd" * 32
        poison = http.put(
            f"{instance}blocks/{compat}/{scope}/{key}",
            content=container(1).tobytes(),
            headers={**auth, "content-type": "application/kvsp-block", "if-none-match": "*"},
        )
        assert poison.status_code == 403
        for path in (
            "events", f"sessions/{session}/tokens", f"blocks/{compat}/{scope}/{key}",
            "shards/m/kv?tokens=0-16", "status",
        ):  # fmt: skip
            assert http.get(instance + path, headers=auth).status_code == 403, path
        # a tenant's own client cannot read another's session either; nor name tenants
        client = {"authorization": "Bearer c-demo"}
        assert http.get(f"{up.controller.url}sessions/{session}", headers=client).status_code == 404
        place = {"tenant": "other", "compat_id": compat, "tokens": [1, 2, 3]}
        nobody = {**place, "tenant": "nobody"}
        a = http.post(up.controller.url + "place", json=place, headers=client)
        b = http.post(up.controller.url + "place", json=nobody, headers=client)
        assert (a.status_code, b.status_code) == (403, 403)
        assert a.json()["detail"].replace("other", "") == b.json()["detail"].replace("nobody", "")


def test_metrics_need_a_scrapers_token_and_every_file_is_the_owners(cluster: Any) -> None:
    up: LocalCluster = cluster
    with httpx.Client(timeout=10) as http:
        for process in up.processes:
            assert http.get(process.url + "metrics").status_code == 401, process.name
            scraped = http.get(
                process.url + "metrics", headers={"authorization": f"Bearer {up.metrics_token}"}
            )
            assert scraped.status_code == 200, process.name
    assert stat.S_IMODE(up.folder.stat().st_mode) == 0o700
    for path in up.folder.iterdir():
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    info = json.loads((up.folder / "cluster.json").read_text())
    assert set(info["api_keys"]) == {"demo", "other"}


def test_two_tenants_may_use_one_session_name(cluster: Any) -> None:
    up: LocalCluster = cluster
    base = up.controller.url + "v1/completions"
    with httpx.Client(timeout=120) as http:
        seen = {}
        for tenant, key in up.api_keys.items():
            for how in ("body", "session_id", "header"):
                body: dict[str, Any] = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}
                headers = {"authorization": f"Bearer {key}"}
                if how == "header":
                    headers["x-session-id"] = "chat 1".replace(" ", "-")
                else:
                    body["session" if how == "body" else "session_id"] = "chat-1"
                answer = http.post(base, json=body, headers=headers)
                assert answer.status_code == 200, answer.text
                seen.setdefault(tenant, set()).add(answer.json()["kvsp"]["session"])
        # one session per tenant, whichever way it was named, and not the other tenant's
        assert {t: len(s) for t, s in seen.items()} == {"demo": 1, "other": 1}
        assert seen["demo"] != seen["other"]
        assert seen["demo"] == {tenant_session(up.scope_ids["demo"], "chat-1")}
        bad = http.post(
            base, json={"prompt": "x", "session": "a\nb"},
            headers={"authorization": f"Bearer {up.api_key}"},
        )  # fmt: skip
        assert bad.status_code == 400
        assert re.search("session", bad.json()["detail"])
        unknown = http.get(
            f"{up.controller.url}sessions/{uuid.uuid4()}",
            headers={"authorization": "Bearer c-demo"},
        )
        foreign = http.get(
            f"{up.controller.url}sessions/{next(iter(seen['other']))}",
            headers={"authorization": "Bearer c-demo"},
        )
        assert (unknown.status_code, foreign.status_code) == (404, 404)
        assert unknown.json()["title"] == foreign.json()["title"]
