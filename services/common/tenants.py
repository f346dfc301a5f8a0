"""Tenants and their bearer tokens: one table for the API (who is calling) and for the builder and workers
(which token to show the store for a tenant's documents). Same formats as the store's `--tokens-file` and
`REDKNOT_STORE_TOKENS`, checked by the store's own rules (`TokenTable`); a tokens file is followed as the store
follows its own (`FollowsFile`): tokens are added, rotated or revoked without a restart."""
from __future__ import annotations

import hashlib
import hmac

from services.store.auth import FollowsFile, TokenTable, parse_token_pairs


class Tenants(FollowsFile):
    def __init__(self, pairs: dict[str, str]):
        """`pairs`: tenant -> token."""
        self._build(pairs)

    def _build(self, pairs: dict[str, str]) -> None:
        TokenTable(pairs)                          # tenant names, token length, no shared tokens
        by_hash = [(hashlib.sha256(t.encode()).digest(), tenant) for tenant, t in pairs.items()]
        self._table = (dict(pairs), by_hash)       # one assignment: a lookup sees one table, whole

    @staticmethod
    def load(spec: str = "", file: str = "") -> "Tenants":
        tenants = Tenants(parse_token_pairs(spec, file))
        tenants._watch(spec, file)
        return tenants

    def __len__(self) -> int:
        return len(self._table[0])

    def tenant(self, token: str) -> str | None:
        """The tenant a bearer token belongs to, or None; digests are compared in constant time."""
        if not token:
            return None
        self._follow()
        d = hashlib.sha256(token.encode()).digest()
        found = None
        for h, tenant in self._table[1]:
            if hmac.compare_digest(h, d):
                found = tenant
        return found

    def any_token(self) -> str:
        """One tenant's token (the first tenant by name; "" when there is none), for the reads every tenant may make:
        the store's calibration records."""
        self._follow()
        pairs = self._table[0]
        return pairs[min(pairs)] if pairs else ""

    def token(self, tenant: str) -> str:
        self._follow()
        return self._table[0][tenant]
