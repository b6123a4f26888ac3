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

step "An Index Service (development mode, memory store): publish two replicas, then look up"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
kvsp index serve --port "$port" --log-level warning 2>"$work/index.log" &
index_pid=$!
trap 'kill $index_pid 2>/dev/null; rm -rf "$work"' EXIT
base="http://127.0.0.1:$port/kvsp/"
for _ in $(seq 100); do curl -sf "${base}healthz" >/dev/null && break; sleep 0.1; done
scope_id=$(kvsp scope-id --scope-key "$scope_key")
mapfile -t keys < <(kvsp block-keys --scope-key "$scope_key" --compat-id "$compat" \
    --block-tokens 16 --tokens "$tokens")
for key in "${keys[@]}"; do
    kvsp container inspect "$work/block.kvb" |
        python3 -c '
import json, sys
compat, scope, key, size = sys.argv[1:]
c = json.load(sys.stdin)
print(json.dumps({
    "block_key": key, "compat_id": compat, "scope_id": scope,
    "holder": "http://127.0.0.1:9101/kvsp/", "codec": c["codec"], "size": int(size),
    "digest": "sha-256:" + c["digest"], "layer_digests": [l["digest"] for l in c["layers"]],
    "residency": [{"tier": "host", "layers": [0, c["layer_count"] - 1]}], "ttl_ms": 60000}))
' "$compat" "$scope_id" "$key" "$(stat -c %s "$work/block.kvb")" > "$work/record.json"
    curl -s -X PUT -H 'content-type: application/kvsp+json' --data @"$work/record.json" \
        "${base}replicas/$compat/$scope_id/$key"; echo
done
printf '{"scope_id":"%s","compat_id":"%s","block_keys":["%s","%s","%s"]}' "$scope_id" "$compat" \
    "${keys[0]}" "${keys[1]}" "$(printf 'f%.0s' {1..64})" > "$work/lookup.json"
curl -s -X POST -H 'content-type: application/kvsp+json' --data @"$work/lookup.json" "${base}lookup" |
    python3 -c 'import json, sys; d = json.load(sys.stdin); print("matched", d["matched"], "of 3 keys;", [r[0]["holder"] for r in d["replicas"]])'
echo "a record whose residency overlaps is refused, and nothing is stored:"
python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r["residency"]=[{"tier":"host","layers":[0,1]},{"tier":"disk","layers":[1,1]}]; print(json.dumps(r))' "$work/record.json" > "$work/bad.json"
curl -s -X PUT -H 'content-type: application/kvsp+json' --data @"$work/bad.json" \
    "${base}replicas/$compat/$scope_id/${keys[1]}"; echo
