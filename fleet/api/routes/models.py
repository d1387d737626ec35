"""Model versions and their artifacts (fleet/catalog/; docs/weights.md)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/models", tags=["models"])
