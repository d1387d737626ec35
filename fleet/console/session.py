"""Console sign-in: the API's own tokens, held in an encrypted session cookie.

- **Sign-in** takes a token from `fleetctl token create` (viewer, operator or admin; never an
  agent's or a router's) and checks it as the API does (`edge.authenticate_token`). The cookie
  holds the token and a random CSRF value, encrypted and authenticated with the fleet's secret
  key (Fernet, as the BMC credentials are), so the browser keeps nothing it can read or forge.
  Every request checks the token again: a revoked or expired token ends its sessions at once.
- **The cookie** is HttpOnly (no script reads it), SameSite=Strict (no other site's page sends
  it), Path=/ui, and Secure when the service speaks TLS. It lives `LIFETIME_S` (12 h).
- **CSRF.** Every form carries the session's CSRF value; a POST whose value is missing or
  differs is refused (403) before anything happens. SameSite=Strict already keeps other sites'
  forms out; the value also stops a page of this origin that is not the console's.
- **Sign-in CSRF.** The sign-in form carries a random value that also sits in a SameSite=Strict
  cookie of its own; a POST without both equal is refused, so no page elsewhere can sign a
  browser in with another token.
- Nothing secret reaches a page or a URL: pages show the token's name and role, never the
  token; sign-in is a POST.
"""

from __future__ import annotations

import hmac
import json
import secrets
from dataclasses import dataclass

from fleet.auth import Principal
from fleet.crypto import SecretBox
from fleet.models import Role

__all__ = ["COOKIE", "LIFETIME_S", "Session", "issue", "read", "same_csrf"]

COOKIE = "fleet_console"
LOGIN_COOKIE = "fleet_console_login"  # the sign-in form's CSRF value (fleet/console/routes.py)
LIFETIME_S = 12 * 3600
CONSOLE_ROLES = frozenset({Role.VIEWER, Role.OPERATOR, Role.ADMIN})


@dataclass(frozen=True, slots=True)
class Session:
    token: str
    csrf: str


def issue(box: SecretBox, token: str) -> tuple[str, Session]:
    """A new session for `token`: the cookie's value and what it holds."""
    session = Session(token, secrets.token_urlsafe(32))
    return box.encrypt(json.dumps({"t": session.token, "c": session.csrf})), session


def read(box: SecretBox, cookie: str | None) -> Session | None:
    """The session a cookie holds, if this fleet issued it within LIFETIME_S."""
    if not cookie or len(cookie) > 4096:
        return None
    plain = box.decrypt_within(cookie, LIFETIME_S)
    if plain is None:
        return None
    try:
        data = json.loads(plain)
        return Session(str(data["t"]), str(data["c"]))
    except (ValueError, KeyError, TypeError):
        return None


def same_csrf(session: Session, sent: str | None) -> bool:
    return sent is not None and hmac.compare_digest(session.csrf.encode(), sent.encode())


def may_sign_in(principal: Principal) -> bool:
    return principal.role in CONSOLE_ROLES
