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

step "An Index Service and a holder (development mode): the holder stores blocks and publishes them"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
index_port=$(free_port)
holder_port=$(free_port)
base="http://127.0.0.1:$index_port/kvsp/"
holder="http://127.0.0.1:$holder_port/kvsp/"
kvsp index serve --port "$index_port" --log-level warning 2>"$work/index.log" &
pids=($!)
kvsp holder serve --url "$holder" --port "$holder_port" --index "$base" --host-bytes 64M \
    --disk-dir "$work/disk" --disk-bytes 256M --log-level warning 2>"$work/holder.log" &
pids+=($!)
trap 'kill "${pids[@]}" 2>/dev/null; rm -rf "$work"' EXIT
for url in "$base" "$holder"; do
    for _ in $(seq 100); do curl -sf "${url}healthz" >/dev/null && break; sleep 0.1; done
done
scope_id=$(kvsp scope-id --scope-key "$scope_key")
mapfile -t keys < <(kvsp block-keys --scope-key "$scope_key" --compat-id "$compat" \
    --block-tokens 16 --tokens "$tokens")
for key in "${keys[@]}"; do
    curl -s -X PUT -H 'content-type: application/kvsp-block' -H 'if-none-match: *' \
        --data-binary @"$work/block.kvb" "${holder}blocks/$compat/$scope_id/$key" |
        python3 -c 'import json, sys; r = json.load(sys.stdin); print("stored", r["block_key"][:16] + "...", "size", r["size"], "residency", r["residency"])'
done
echo "storing the same key again is refused (412), and the first copy stays:"
curl -s -X PUT -H 'content-type: application/kvsp-block' -H 'if-none-match: *' \
    --data-binary @"$work/block.kvb" "${holder}blocks/$compat/$scope_id/${keys[0]}"; echo

step "Lookup at the Index Service: the prefix stops at the first key nobody holds"
printf '{"scope_id":"%s","compat_id":"%s","block_keys":["%s","%s","%s"]}' "$scope_id" "$compat" \
    "${keys[0]}" "${keys[1]}" "$(printf 'f%.0s' {1..64})" > "$work/lookup.json"
for _ in $(seq 50); do
    matched=$(curl -s -X POST -H 'content-type: application/kvsp+json' --data @"$work/lookup.json" \
        "${base}lookup" | python3 -c 'import json, sys; print(json.load(sys.stdin)["matched"])')
    [ "$matched" = 2 ] && break
    sleep 0.1
done
curl -s -X POST -H 'content-type: application/kvsp+json' --data @"$work/lookup.json" "${base}lookup" |
    python3 -c 'import json, sys; d = json.load(sys.stdin); print("matched", d["matched"], "of 3 keys;", [r[0]["holder"] for r in d["replicas"]])'

step "GET layer 1 of the first block from the holder: headers, then the container"
curl -s -D "$work/headers" -o "$work/layer1.kvb" "${holder}blocks/$compat/$scope_id/${keys[0]}?layers=1-1"
grep -i -E '^(content-type|repr-digest|cache-control):' "$work/headers"
kvsp container inspect "$work/layer1.kvb" | python3 -c 'import json, sys; c = json.load(sys.stdin); print("layers", c["first_layer"], "-", c["first_layer"] + c["layer_count"] - 1, "digest of layer 1:", c["layers"][0]["digest"][:16] + "...")'

echo "a record whose residency overlaps is refused by the Index Service, and nothing is stored:"
python3 -c '
import json, sys
compat, scope, key = sys.argv[1:]
print(json.dumps({"block_key": key, "compat_id": compat, "scope_id": scope,
    "holder": "http://127.0.0.1:9/kvsp/", "codec": 1, "size": 100, "digest": "sha-256:" + "0" * 64,
    "residency": [{"tier": "host", "layers": [0, 1]}, {"tier": "disk", "layers": [1, 1]}],
    "ttl_ms": 60000}))' "$compat" "$scope_id" "${keys[1]}" > "$work/bad.json"
curl -s -X PUT -H 'content-type: application/kvsp+json' --data @"$work/bad.json" \
    "${base}replicas/$compat/$scope_id/${keys[1]}"; echo
