#!/usr/bin/env bash
# A walk through the KVSP core with the `kvsp` command line: identity of a cache configuration,
# a tenant scope, the Block Keys of a prompt, and a two-layer KV Block Container.
# The descriptor's digests are example values (`kvsp model install` derives real ones).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

step() { printf '\n== %s\n' "$*"; }

step "Compatibility ID of $here/descriptor.json (JCS + SHA-256, KVSP 4.1)"
compat=$(kvsp compat-id "$here/descriptor.json")
echo "$compat"

step "A tenant scope: a fresh 32-octet scope key and its Scope ID (KVSP 4.2)"
scope_key=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
kvsp scope-id --scope-key "$scope_key"

step "Block Keys of a 40-token prompt with 16-token blocks (2 complete blocks, 8 tokens unshared)"
tokens=$(python3 -c 'print(",".join(str(1000 + i) for i in range(40)))')
kvsp block-keys --scope-key "$scope_key" --compat-id "$compat" --block-tokens 16 --tokens "$tokens"

step "A container of layers 0-1 of one block (16 tokens x 3 heads x 64 dims, float32)"
for name in k0 v0 k1 v1; do head -c 12288 /dev/urandom > "$work/$name"; done
kvsp container build --first-layer 0 --token-count 16 --descriptor "$here/descriptor.json" \
    --out "$work/block.kvb" "$work/k0" "$work/v0" "$work/k1" "$work/v1"
kvsp container inspect --descriptor "$here/descriptor.json" "$work/block.kvb"

step "Malformed input is refused with one line and status 2"
head -c 100 "$work/block.kvb" > "$work/truncated.kvb"
if kvsp container inspect "$work/truncated.kvb"; then exit 1; else echo "(exit status $?)"; fi
