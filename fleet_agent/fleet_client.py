"""The agent's only door to the fleet: register and heartbeat over the REST API.

Typed both ways with the core's wire models (fleet_core/wire.py): the service validates the
same models, so a report this client sends is one the fleet can read.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
from pydantic import ValidationError

from fleet_core.wire import HEARTBEAT_PATH, REGISTER_PATH, Heartbeat, Registration, Reply


class FleetUnreachable(RuntimeError):
    """The fleet did not answer (down, restarting, network): retry with backoff."""


class FleetRefused(RuntimeError):
    """The fleet answered no (401 bad token, 403 another server's token, 422 a bad report):
    retrying will not help until an operator fixes the agent's configuration."""


class FleetClient:
    def __init__(
        self,
        url: str,
        token: str | Callable[[], str],
        timeout: float,
        transport: httpx.BaseTransport | None = None,
        ca_bundle: Path | None = None,
    ) -> None:
        # An https fleet is verified: against `ca_bundle` only when given, else the system's CAs.
        verify = ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle else None)
        # A callable is asked before each request (config.TokenFile: a rotated token is used
        # from the next request on, without a restart).
        self._token = token if callable(token) else (lambda: token)
        self._client = httpx.Client(
            base_url=url.rstrip("/"),
            timeout=timeout,
            transport=transport,
            verify=verify,
        )

    def register(self, report: Registration) -> Reply:
        return self._post(REGISTER_PATH, report.to_wire())

    def heartbeat(self, report: Heartbeat) -> Reply:
        return self._post(HEARTBEAT_PATH, report.to_wire())

    def close(self) -> None:
        self._client.close()

    def _post(self, path: str, body: dict[str, Any]) -> Reply:
        try:
            response = self._client.post(
                path,
                json=printable(body),
                headers={"Authorization": f"Bearer {self._token()}"},
            )
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
        try:
            return Reply.model_validate_json(response.content)
        except ValidationError as exc:
            # Not the fleet's answer (a proxy's page?): like no answer, retried with backoff.
            raise FleetUnreachable(f"{path}: an answer this agent cannot read: {exc}") from exc


# C0 (tab and newline included), DEL and C1: the fleet refuses them in every string it is sent
# (fleet/api/edge.py), and a driver's Xid text or an engine's error can carry them.
_T = TypeVar("_T")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def printable(value: _T) -> _T:
    """A report with every string's control characters replaced by spaces: one odd byte in a
    reason must not get every heartbeat refused (and the server power cycled for silence)."""
    return cast(_T, _printable(value))


def _printable(value: object) -> object:
    if isinstance(value, str):
        return _CONTROL.sub(" ", value)
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value
