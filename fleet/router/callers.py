"""Who may call the router: client keys and their tenants, from the fleet or a file.

The fleet's `GET /api/v1/routing/callers` (a router token; it holds key hashes) lists the
active keys, each with its sha256 hash, id, name, tenant and limits, and the tenants with their
concurrency shares. A callers file has the same shape (JSON or YAML); a key there may give
`"key": "fk_…"` (its plaintext, for test setups) in place of `"hash"`, and `id` defaults to its
`name`. Both are read again every `fleet_poll_s`: a key gone from the list (revoked, expired,
deleted) is refused from the next read on.

A request's `Authorization: Bearer fk_…` is hashed (sha256) and looked up in one dict: the
router never holds a key's plaintext beyond the request, and never logs or shows a hash.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from fleet.router.limits import KeyLimits

ANONYMOUS = "anonymous"  # the tenant of every request when client authentication is off
_HASH = re.compile(r"^[0-9a-f]{64}$")


class CallersError(ValueError):
    """The callers document is malformed (the message says where)."""


@dataclass(frozen=True)
class Caller:
    """An authenticated key: its limits (by id), name and tenant."""

    limits: KeyLimits
    name: str
    tenant: str

    @property
    def key_id(self) -> str:
        return self.limits.key_id


@dataclass
class Callers:
    """The active keys by hash, and each tenant's concurrency share."""

    by_hash: dict[str, Caller] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)

    def authenticate(self, authorization: str | None) -> Caller | None:
        """The caller of an `Authorization` header, None when missing or unknown."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        key = authorization[7:].strip()
        if not key:
            return None
        return self.by_hash.get(key_hash(key))

    def share(self, tenant: str) -> float:
        return self.shares.get(tenant, 1.0)

    def ids(self) -> set[str]:
        return {c.key_id for c in self.by_hash.values()}


ANONYMOUS_CALLER = Caller(KeyLimits(key_id=""), name="", tenant=ANONYMOUS)


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _limit(entry: dict[str, Any], name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CallersError(f"{where}: {name} must be a positive integer or null")
    return value


def parse_callers(doc: Any) -> Callers:
    """The callers document (the fleet's answer or a file's content) as `Callers`."""
    if not isinstance(doc, dict):
        raise CallersError("the callers document must be an object with tenants and keys")
    shares: dict[str, float] = {}
    for i, tenant in enumerate(doc.get("tenants") or []):
        if not isinstance(tenant, dict) or not isinstance(tenant.get("name"), str):
            raise CallersError(f"tenants[{i}]: needs a name")
        share = tenant.get("concurrency_share", 1.0)
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise CallersError(f"tenants[{i}]: concurrency_share must be in (0, 1]")
        shares[tenant["name"]] = float(share)
    by_hash: dict[str, Caller] = {}
    for i, entry in enumerate(doc.get("keys") or []):
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise CallersError(f"{where}: must be an object")
        name = entry.get("name")
        tenant = entry.get("tenant")
        if not isinstance(name, str) or not isinstance(tenant, str):
            raise CallersError(f"{where}: needs a name and a tenant")
        plaintext = entry.get("key")
        digest = key_hash(plaintext) if isinstance(plaintext, str) else entry.get("hash")
        if not isinstance(digest, str) or not _HASH.match(digest):
            raise CallersError(f"{where} ({name}): needs a hash (sha256 hex) or a key")
        key_id = entry.get("id", name)
        if isinstance(key_id, bool) or not isinstance(key_id, int | str):
            raise CallersError(f"{where} ({name}): id must be an integer or a string")
        limits = KeyLimits(
            key_id=str(key_id),
            requests_per_minute=_limit(entry, "requests_per_minute", where),
            tokens_per_minute=_limit(entry, "tokens_per_minute", where),
        )
        by_hash[digest] = Caller(limits, name=name, tenant=tenant)
    return Callers(by_hash=by_hash, shares=shares)


def read_file(path: Path) -> Callers:
    return parse_callers(yaml.safe_load(path.read_text()))


async def fetch(http: aiohttp.ClientSession, fleet_url: str, token: str | None) -> Callers:
    """GET /api/v1/routing/callers (a router token)."""
    url = f"{fleet_url.rstrip('/')}/api/v1/routing/callers"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = aiohttp.ClientTimeout(total=5)
    async with http.get(url, headers=headers, timeout=timeout) as response:
        if response.status != 200:
            text = (await response.text())[:200]
            raise RuntimeError(f"GET {url}: HTTP {response.status}: {text}")
        return parse_callers(await response.json())
