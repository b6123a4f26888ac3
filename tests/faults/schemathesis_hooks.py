"""Loaded by schemathesis (``SCHEMATHESIS_HOOKS``): KVB1 blocks are sent as the octets
generated for them, like any binary body."""

import schemathesis

schemathesis.serializer.alias("application/kvsp-block", "application/octet-stream")
