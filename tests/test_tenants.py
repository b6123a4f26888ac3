"""The tenants file: shared scopes, quotas, who may act for a tenant, and tenant sessions."""

from __future__ import annotations

import pytest

from kvsp.auth import Principal, Role
from kvsp.core.ids import tenant_session
from kvsp.core.keys import block_keys
from kvsp.core.problems import ConfigurationError, Forbidden
from kvsp.quotas import Quota
from kvsp.tenants import Tenants
from tests.index.factories import COMPAT

ACME, GLOBEX, OUTSIDER, SHARED = "11" * 32, "22" * 32, "33" * 32, "44" * 32
PREFIX = list(range(1, 41))  # 2 whole blocks of 16, and 8 tokens not shared


def tenants(shared: str = f"prefix_tokens = {PREFIX}") -> Tenants:
    return Tenants.parse(
        f'[tenants.acme]\nscope_key = "{ACME}"\ncompat_ids = ["{COMPAT}"]\n'
        '[tenants.acme.quota]\nstored_octets = "1G"\n'
        f'[tenants.globex]\nscope_key = "{GLOBEX}"\ncompat_ids = ["{COMPAT}"]\n'
        f'[tenants.outsider]\nscope_key = "{OUTSIDER}"\ncompat_ids = ["{COMPAT}"]\n'
        '[quota]\npinned_octets = "64M"\n'
        f'[shared.system]\nscope_key = "{SHARED}"\ntenants = ["acme", "globex"]\n{shared}\n',
        tokenize=lambda text: [ord(c) for c in text],
    )


def test_the_allowed_tenants_share_the_prefix_blocks_and_nothing_after() -> None:
    parsed = tenants()
    prompt = [*PREFIX, 7, 7, 7, 7, 7, 7, 7, 7, 9] + [5] * 16
    acme, globex, outsider = (
        parsed.get(n).chain(COMPAT, 16) for n in ("acme", "globex", "outsider")
    )
    a, g, o = acme.extend(prompt), globex.extend(prompt), outsider.extend(prompt)
    assert a[:2] == g[:2]  # one set of shared blocks
    assert a[2:] != g[2:]  # the rest is each tenant's own
    assert not set(o) & set(a)  # a tenant not listed never hits them
    assert not set(o) & set(g)
    assert o == block_keys(bytes.fromhex(OUTSIDER), bytes.fromhex(COMPAT), prompt, 16)
    assert acme.scope_of(1) == globex.scope_of(1) != acme.scope_of(2)
    assert parsed.get("acme").scopes() == [parsed.get("acme").scope_id, acme.scope_of(0)]


def test_a_checkpoints_keys_tell_which_blocks_are_shared() -> None:
    acme = tenants().get("acme")
    prompt = [*PREFIX, *range(200, 224)]
    keys = [k.hex() for k in acme.chain(COMPAT, 16).extend(prompt)]
    after = acme.chain_after(COMPAT, 16, keys[:3])
    shared = acme.shared[0].scope_id
    assert [after.scope_of(i) for i in range(4)] == [shared, shared, acme.scope_id, acme.scope_id]


def test_a_system_prompt_is_tokenized_by_the_service() -> None:
    parsed = tenants('prefix_system = "' + "x" * 40 + '"')
    (shared,) = parsed.get("acme").shared
    assert shared.tokens == (ord("x"),) * 40
    with pytest.raises(ConfigurationError, match="tokenizer"):
        Tenants.parse(
            f'[tenants.a]\nscope_key = "{ACME}"\n'
            f'[shared.s]\nscope_key = "{SHARED}"\ntenants = ["a"]\nprefix_system = "hi"\n'
        )


@pytest.mark.parametrize(
    "shared",
    [
        f'[shared.s]\nscope_key = "{SHARED}"\ntenants = ["nobody"]\nprefix_tokens = [1]\n',
        f'[shared.s]\nscope_key = "{SHARED}"\ntenants = ["a"]\n',  # no prefix
        f'[shared.s]\nscope_key = "{ACME}"\ntenants = ["a"]\nprefix_tokens = [1]\n',  # a's key
        f'[shared.s]\nscope_key = "{SHARED}"\ntenants = ["a"]\nprefix_tokens = [-1]\n',
        '[shared.s]\nscope_key = "12"\ntenants = ["a"]\nprefix_tokens = [1]\n',
    ],
)
def test_a_bad_shared_scope_is_a_configuration_error(shared: str) -> None:
    with pytest.raises(ConfigurationError):
        Tenants.parse(f'[tenants.a]\nscope_key = "{ACME}"\n{shared}')


def test_quotas_come_by_scope_id() -> None:
    parsed = tenants()
    acme = parsed.get("acme")
    assert parsed.quotas.of(acme.scope_id) == Quota(stored_octets=1 << 30, pinned_octets=64 << 20)
    assert parsed.quotas.of(parsed.get("globex").scope_id) == Quota(pinned_octets=64 << 20)
    assert "scope_key" not in parsed.quotas.to_toml()
    assert ACME not in parsed.quotas.to_toml()


def test_a_principal_acts_only_for_its_tenants_and_unknown_names_look_the_same() -> None:
    parsed = tenants()
    acme = parsed.get("acme")
    client = Principal("c", frozenset({Role.CLIENT}), frozenset({acme.scope_id}), frozenset())
    assert parsed.for_principal(client, "acme") is acme
    with pytest.raises(Forbidden) as foreign:
        parsed.for_principal(client, "globex")
    with pytest.raises(Forbidden) as unknown:
        parsed.for_principal(client, "nobody")
    assert foreign.value.title == unknown.value.title
    assert parsed.by_scope(acme.scope_id) is acme


def test_session_names_are_namespaced_by_tenant() -> None:
    a, b = tenants().get("acme").scope_id, tenants().get("globex").scope_id
    assert tenant_session(a, "chat-1") == tenant_session(a, "chat-1")
    assert tenant_session(a, "chat-1") != tenant_session(b, "chat-1")
    assert tenant_session(a, "chat-1") != "chat-1"
