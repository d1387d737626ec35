"""Rollouts of a deployment's model version (fleet/rollout/; docs/weights.md)."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/deployments", tags=["deployments"])
