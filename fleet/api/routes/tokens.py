"""Agent tokens through the API (docs/api.md): mint, list, revoke, rotate. Filled by issue 22."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/tokens", tags=["tokens"])
