"""The agent's only door to the fleet: register and heartbeat over the REST API."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx


class FleetUnreachable(RuntimeError):
    """The fleet did not answer (down, restarting, network): retry with backoff."""


class FleetRefused(RuntimeError):
    """The fleet answered no (401 bad token, 403 another server's token, 422 a bad report):
    retrying will not help until an operator fixes the agent's configuration."""


class FleetClient:
    def __init__(
        self,
        url: str,
        token: str,
        timeout: float,
        transport: httpx.BaseTransport | None = None,
        ca_bundle: Path | None = None,
    ) -> None:
        # An https fleet is verified: against `ca_bundle` only when given, else the system's CAs.
        verify = ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle else None)
        self._client = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout,
            transport=transport,
            verify=verify,
        )

    def register(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/api/v1/agent/register", body)

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._post("/api/v1/agent/heartbeat", body)

    def close(self) -> None:
        self._client.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise FleetUnreachable(f"{path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise FleetUnreachable(f"{path}: HTTP {response.status_code}")
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise FleetRefused(f"{path}: HTTP {response.status_code}: {detail}")
        answer: dict[str, Any] = response.json()
        return answer
