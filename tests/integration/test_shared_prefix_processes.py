"""A shared public prefix (KVSP 4.2) across real instances: the tenants listed for it reuse its
blocks, locally and through the Index Service; a tenant not listed never hits them; nothing
after the prefix is ever shared; every answer equals the one computed from scratch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.instances import PROMPT, Cluster, generate
from tests.servers import running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SHARED = PROMPT[:32]  # two whole blocks: the shared prefix; PROMPT's third block is a tenant's


def tenants_toml(compat: str) -> str:
    keys = {"acme": "55", "globex": "66", "outsider": "77"}
    out = [f'[tenants.{n}]\nscope_key = "{k * 32}"\ncompat_ids = ["{compat}"]\n' for n, k in
           keys.items()]  # fmt: skip
    out.append(
        f'[shared.story]\nscope_key = "{"88" * 32}"\ntenants = ["acme", "globex"]\n'
        f"prefix_tokens = {SHARED}\n"
    )
    return "\n".join(out)


async def test_listed_tenants_share_the_prefix_and_nothing_else(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat)
    cluster.tenants.write_text(tenants_toml(compat))
    a, b = cluster.instance(), cluster.instance()
    with running(cluster.index, cluster.holder, a, b):
        first = await generate(a.base_url, PROMPT, 24, tenant="acme")
        assert first["summary"]["cached_tokens"] == 0
        # another listed tenant: exactly the shared blocks, none of acme's third block
        globex = await generate(a.base_url, PROMPT, 24, tenant="globex")
        assert globex["summary"]["cached"] == {"g1": 32}
        # a tenant not listed: nothing at all
        outsider = await generate(a.base_url, PROMPT, 24, tenant="outsider")
        assert outsider["summary"]["cached_tokens"] == 0
        # on the other instance: the shared blocks and globex's own, through the IS, each in
        # its scope (two lookups)
        again = await generate(b.base_url, PROMPT, 24, tenant="globex")
        assert again["summary"]["cached"] == {"remote": 48}
        for answer in (first, globex, outsider, again):
            assert answer["tokens"] == reference
