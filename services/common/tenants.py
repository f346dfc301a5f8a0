"""Tenants and their bearer tokens: one table for the API (who is calling) and for the builder and workers
(which token to show the store for a tenant's documents). Same formats as the store's `--tokens-file` and
`REDKNOT_STORE_TOKENS`, checked by the store's own rules (`TokenTable`)."""
from __future__ import annotations

import hashlib
import hmac

from services.store.auth import TokenTable, parse_token_pairs


class Tenants:
    def __init__(self, pairs: dict[str, str]):
        """`pairs`: tenant -> token."""
        TokenTable(pairs)                          # tenant names, token length, no shared tokens
        self._tokens = dict(pairs)
        self._by_hash = [(hashlib.sha256(t.encode()).digest(), tenant) for tenant, t in pairs.items()]

    @staticmethod
    def load(spec: str = "", file: str = "") -> "Tenants":
        return Tenants(parse_token_pairs(spec, file))

    def __len__(self) -> int:
        return len(self._tokens)

    def tenant(self, token: str) -> str | None:
        """The tenant a bearer token belongs to, or None; digests are compared in constant time."""
        if not token:
            return None
        d = hashlib.sha256(token.encode()).digest()
        found = None
        for h, tenant in self._by_hash:
            if hmac.compare_digest(h, d):
                found = tenant
        return found

    def token(self, tenant: str) -> str:
        return self._tokens[tenant]
