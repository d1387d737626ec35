"""TLS for the fleet's own clients and servers (docs/api.md, "TLS").

Clients verify by default: the system's CAs, or only the CAs of a bundle when one is given (a
private CA for the fleet). There is no switch to turn verification off. A client certificate is
presented where one is configured (the fleet and routers to agents that require one).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from fleet.errors import FleetError


def client_context(
    ca_bundle: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> ssl.SSLContext:
    """A verifying client context: hostnames checked, certificates against `ca_bundle` (else
    the system's CAs), presenting `cert` + `key` when given."""
    try:
        context = ssl.create_default_context(cafile=str(ca_bundle) if ca_bundle else None)
        if cert is not None:
            context.load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError included
        raise FleetError(f"TLS client: cannot load {_names(ca_bundle, cert, key)}: {exc}") from exc
    return context


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server context for `cert` + `key`; FleetError when they do not load (or match)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except OSError as exc:  # ssl.SSLError included
        raise FleetError(f"TLS: cannot load certificate {cert} with key {key}: {exc}") from exc
    return context


def check_server_pair(cert: Path, key: Path) -> None:
    """Refuse, before anything listens, a certificate and key that do not load."""
    server_context(cert, key)


def _names(*paths: Path | None) -> str:
    return ", ".join(str(p) for p in paths if p is not None) or "the system's CAs"
