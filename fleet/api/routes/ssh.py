"""Servers over SSH (docs/ansible.md): host-key pinning and diagnostic bundles. Filled by
issue 22."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["ssh"])
