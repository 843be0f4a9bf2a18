"""API key → tenant.

Keys are configured only as SHA-256 digests, so the config file holds no secret. The
presented key is hashed and the digest looked up; the final equality uses
``hmac.compare_digest``. A lookup keyed by the digest leaks at most timing about a digest,
which tells an attacker nothing about a key (pre-image resistance), while staying O(1) for
fleets with thousands of keys.
"""

from __future__ import annotations

import hashlib
import hmac

from extproc.config import TenantSpec

# Headers a client could send to claim an identity or a cost. Never trusted: always removed
# before the request goes upstream, whatever their value.
UNTRUSTED_HEADERS = (
    "x-tenant-id",
    "x-tenant",
    "x-plan",
    "x-token-cost",
    "x-prompt-tokens",
    "x-quota-tenant",
    "x-quota-model",
    "x-ratelimit-bypass",
)


class KeyRing:
    def __init__(self, tenants: dict[str, TenantSpec]) -> None:
        self._by_digest: dict[bytes, tuple[bytes, TenantSpec]] = {}
        for tenant in tenants.values():
            for hex_digest in tenant.key_sha256:
                digest = bytes.fromhex(hex_digest)
                self._by_digest[digest] = (digest, tenant)

    def identify(self, key: str) -> TenantSpec | None:
        if not key:
            return None
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = self._by_digest.get(digest)
        if found is None:
            return None
        known, tenant = found
        return tenant if hmac.compare_digest(known, digest) else None


def presented_key(headers: dict[str, str]) -> str | None:
    """The API key from ``Authorization: Bearer <key>`` or, failing that, ``x-api-key``."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key")
    return key.strip() if key else None
