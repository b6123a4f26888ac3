"""Principals file, bearer authentication, and authorization decisions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsp.auth import DEVELOPMENT, Principals, Role, authorize, token_sha256
from kvsp.core.problems import ConfigurationError, Forbidden, Unauthenticated
from kvsp.core.urls import canonical_url
from tests.index.factories import namespace

SCOPE_A = "aa" * 16
SCOPE_B = "bb" * 16
FILE = f"""
[principals.holder-1]
token_sha256 = "{token_sha256("holder-token")}"
roles = ["holder"]
holders = ["HTTP://127.0.0.1:9101/kvsp"]
scopes = ["{SCOPE_A}"]

[principals.pc]
token_sha256 = "{token_sha256("pc-token")}"
roles = ["controller"]
scopes = ["*"]

[principals.ops]
token_sha256 = "{token_sha256("ops-token")}"
roles = ["admin"]
scopes = ["{SCOPE_B}"]
holders = ["*"]
"""


@pytest.fixture
def principals() -> Principals:
    return Principals.parse(FILE)


def test_authenticate(principals: Principals) -> None:
    assert principals.authenticate("Bearer holder-token").name == "holder-1"
    assert principals.authenticate("bearer  pc-token ").name == "pc"
    for header in (None, "", "Bearer", "Basic abc", "Bearer wrong"):
        with pytest.raises(Unauthenticated):
            principals.authenticate(header)


def test_holder_may_publish_only_for_itself_and_its_scopes(principals: Principals) -> None:
    holder = principals.authenticate("Bearer holder-token")
    authorize(holder, Role.HOLDER, scope=SCOPE_A, holder="http://127.0.0.1:9101/kvsp/")
    with pytest.raises(Forbidden, match="scope"):
        authorize(holder, Role.HOLDER, scope=SCOPE_B)
    with pytest.raises(Forbidden, match="may not act for holder"):
        authorize(holder, Role.HOLDER, scope=SCOPE_A, holder="http://127.0.0.1:9102/kvsp/")
    with pytest.raises(Forbidden, match="role controller"):
        authorize(holder, Role.CONTROLLER)


def test_role_alternatives_and_admin(principals: Principals) -> None:
    pc = principals.authenticate("Bearer pc-token")
    authorize(pc, [Role.HOLDER, Role.CONTROLLER], scope=SCOPE_B)
    with pytest.raises(Forbidden, match="holder"):
        authorize(pc, Role.CONTROLLER, holder="http://127.0.0.1:9101/kvsp/")
    ops = principals.authenticate("Bearer ops-token")
    authorize(ops, Role.INSTANCE, scope=SCOPE_B, holder="https://anything/")
    with pytest.raises(Forbidden):
        authorize(ops, Role.INSTANCE, scope=SCOPE_A)


def test_development_mode_accepts_everything() -> None:
    dev = Principals.development_mode()
    assert dev.authenticate(None) is DEVELOPMENT
    authorize(DEVELOPMENT, Role.ADMIN, scope=SCOPE_A, holder="http://x/")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not toml = ", "not TOML"),
        ("[other]\n", "non-empty \\[principals\\]"),
        ('[principals.a]\ntoken_sha256 = "abc"\nroles = ["holder"]\n', "64 lowercase hex"),
        (f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = ["boss"]\n', "boss"),
        (f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = []\n', "at least one role"),
        (
            f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = ["holder"]\nscopes = ["x"]\n',
            "hex16",
        ),
        (
            f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = ["holder"]\nholders = ["h1"]\n',
            r"not an http\(s\) URL",
        ),
        (f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = "holder"\n', "list of strings"),
        (
            f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = ["holder"]\ntoken = "x"\n',
            "unknown keys",
        ),
        (
            f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = ["holder"]\n'
            f'[principals.b]\ntoken_sha256 = "{"0" * 64}"\nroles = ["holder"]\n',
            "share a token",
        ),
        ("principals = 3\n", "non-empty"),
        ("[principals]\na = 1\n", "must be a table"),
    ],
)
def test_bad_principals_files(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Principals.parse(text)


def test_load(tmp_path: Path) -> None:
    path = tmp_path / "principals.toml"
    path.write_text(FILE)
    assert Principals.load(path).authenticate("Bearer pc-token").name == "pc"
    with pytest.raises(ConfigurationError, match="cannot read"):
        Principals.load(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("HTTP://Example.COM:80/kvsp", "http://example.com/kvsp/"),
        ("https://h:443/kvsp/", "https://h/kvsp/"),
        ("http://127.0.0.1:9101/kvsp/", "http://127.0.0.1:9101/kvsp/"),
        ("http://[::1]:9000/kvsp/", "http://[::1]:9000/kvsp/"),
    ],
)
def test_canonical_url(url: str, canonical: str) -> None:
    assert canonical_url(url) == canonical


def test_a_moqt_publisher_is_named_by_its_namespace_not_a_relay() -> None:
    ns = namespace(b"kvsp", b"v1", b"compat", b"scope", b"pub")
    base = f'[principals.a]\ntoken_sha256 = "{"0" * 64}"\nroles = ["holder"]\n'
    principals = Principals.parse(base + f'holders = ["moqt-namespace:{ns}"]\n')
    (publisher,) = principals._by_hash.values()
    assert publisher.may_act_for(f"moqt-namespace:{ns}")
    assert not publisher.may_act_for("http://127.0.0.1:9101/kvsp/")
    with pytest.raises(ConfigurationError, match="authorized by its namespace"):
        Principals.parse(base + 'holders = ["moqt://relay.example/"]\n')
    with pytest.raises(ConfigurationError, match="moqt-namespace:AA"):
        Principals.parse(base + 'holders = ["moqt-namespace:AA"]\n')
