"""The fetcher's HTTP client: one GET of a byte range over http.client, for http(s):// and
for s3:// (a signed GET, s3.py). Stdlib only, so a transfer costs what the socket costs:
the body is read with readinto into the caller's large buffer, no per-chunk objects.

It raises its own small exceptions and fetch.py turns them into the typed, named errors: the
phase matters there (a refused connection is retried with backoff, a cut body is resumed from
the bytes written, a 4xx is final, a 5xx is retried).
"""

from __future__ import annotations

import base64
import http.client
import re
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, unquote, urljoin, urlsplit

MAX_REDIRECTS = 5
# The first bytes of an error body read for its S3/XML error code; never more.
ERROR_BODY_BYTES = 4096
USER_AGENT = "fleet-agent-weights/1"
_S3_CODE = re.compile(rb"<Code>([A-Za-z0-9.]{1,64})</Code>")
_CONTENT_RANGE = re.compile(r"^bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)$")


class Unreachable(Exception):
    """No answer: connect refused, name not resolved, timeout, connection lost before the
    status line. Worth retrying with backoff."""


class Cut(Exception):
    """The body stopped short (connection reset, timeout, early EOF): resume from what is
    written."""


class Untrusted(Exception):
    """TLS: the server's certificate did not verify. Retrying does not help."""


class Status(Exception):
    """An answer that is not the body: 4xx (final), 5xx/429 (retry), a redirect too many or
    to somewhere the fetcher does not go. `code`: the S3 error code from the body, if any."""

    def __init__(self, status: int, code: str | None = None, reason: str = "") -> None:
        super().__init__(status, code, reason)
        self.status = status
        self.code = code
        self.reason = reason

    @property
    def retryable(self) -> bool:
        return self.status >= 500 or self.status in (408, 429)


class RangeNotSatisfiable(Exception):
    """416: the range asked for starts at or past the end; `total` is the object's size when
    the server said (Content-Range: bytes */T)."""

    def __init__(self, total: int | None) -> None:
        super().__init__(total)
        self.total = total


@dataclass
class Body:
    """A response body being read: `start` is the offset in the file its first byte belongs
    at (the asked offset for a 206, 0 for a 200: the server ignored Range), `length` the
    bytes it carries when known, `total` the whole object's size when known."""

    start: int
    length: int | None
    total: int | None
    _response: http.client.HTTPResponse
    _conn: http.client.HTTPConnection

    def readinto(self, buffer: memoryview) -> int:
        try:
            return self._response.readinto(buffer)
        except (OSError, http.client.HTTPException) as exc:
            raise Cut(_describe(exc)) from None

    def close(self) -> None:
        self._conn.close()


# (url, headers) for a GET starting at an offset: s3 signs each attempt anew.
RequestFor = Callable[[int], tuple[str, dict[str, str]]]


def get(
    request_for: RequestFor,
    offset: int,
    timeout: float,
    *,
    follow_redirects: bool = True,
    ssl_context: ssl.SSLContext | None = None,
) -> Body:
    """GET from `offset` (a Range request when > 0). Redirects are followed (at most
    MAX_REDIRECTS, http(s) only; credentials are not carried to another host) unless
    `follow_redirects` is off (s3: a signed request is only valid for its host)."""
    url, headers = request_for(offset)
    origin = _split(url).netloc
    for _ in range(MAX_REDIRECTS + 1):
        parts = _split(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise Status(0, reason="redirected to a URL the fetcher does not follow")
        try:
            port = parts.port  # a malformed port ("h:99999", "h:x") raises here
        except ValueError:
            port = 0
        if port == 0:
            raise Status(0, reason="the URL's port is not a port number (1-65535)")
        sent = {"User-Agent": USER_AGENT, "Accept-Encoding": "identity", **headers}
        if offset > 0:
            sent["Range"] = f"bytes={offset}-"
        if parts.username is not None and "Authorization" not in sent:
            userinfo = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            sent["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
        try:
            conn = _connection(parts.scheme, parts.hostname, port, timeout, ssl_context)
        except (ValueError, http.client.HTTPException) as exc:  # InvalidURL and its kin
            raise Status(0, reason=f"unusable URL ({_describe(exc)})") from None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", target, headers=sent)
            response = conn.getresponse()
        except ssl.SSLCertVerificationError as exc:
            conn.close()
            raise Untrusted(exc.verify_message or "certificate verify failed") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise Unreachable(_describe(exc)) from None
        status = response.status
        if status in (301, 302, 303, 307, 308) and follow_redirects:
            location = response.getheader("Location")
            conn.close()
            if not location:
                raise Status(status, reason="redirect without a Location")
            try:
                url = urljoin(url, location)
            except ValueError:
                raise Status(status, reason="redirected to a URL that cannot be parsed") from None
            if _split(url).netloc != origin:
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            continue
        if status in (200, 206):
            return _body(response, conn, offset)
        try:
            if status == 416:
                raise RangeNotSatisfiable(_content_range(response.getheader("Content-Range"))[2])
            raise Status(status, _error_code(response))
        finally:
            conn.close()
    raise Status(0, reason=f"more than {MAX_REDIRECTS} redirects")


def _split(url: str) -> SplitResult:
    """urlsplit, with its ValueError ("http://[::1/w") as a final Status: never a bare
    ValueError past the fetcher."""
    try:
        return urlsplit(url)
    except ValueError:
        raise Status(0, reason="the URL cannot be parsed") from None


def _connection(
    scheme: str, host: str, port: int | None, timeout: float, context: ssl.SSLContext | None
) -> http.client.HTTPConnection:
    if scheme == "https":
        return http.client.HTTPSConnection(
            host, port, timeout=timeout, context=context or ssl.create_default_context()
        )
    return http.client.HTTPConnection(host, port, timeout=timeout)


def _body(
    response: http.client.HTTPResponse, conn: http.client.HTTPConnection, offset: int
) -> Body:
    length_header = response.getheader("Content-Length")
    length = int(length_header) if length_header and length_header.isdigit() else None
    if response.status == 206:
        first, _last, total = _content_range(response.getheader("Content-Range"))
        if first is None:  # a 206 we cannot place: read it as if from 0 would be wrong
            conn.close()
            raise Status(206, reason="partial content without a usable Content-Range")
        return Body(start=first, length=length, total=total, _response=response, _conn=conn)
    return Body(start=0, length=length, total=length, _response=response, _conn=conn)


def _content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    match = _CONTENT_RANGE.match((value or "").strip())
    if not match:
        return None, None, None
    first, last, total = match.groups()
    return (
        int(first) if first is not None else None,
        int(last) if last is not None else None,
        int(total) if total not in (None, "*") else None,
    )


def _error_code(response: http.client.HTTPResponse) -> str | None:
    """The S3 error code (<Code>NoSuchKey</Code>) of an error answer, from its first bytes."""
    try:
        head = response.read(ERROR_BODY_BYTES)
    except (OSError, http.client.HTTPException):
        return None
    match = _S3_CODE.search(head)
    return match.group(1).decode() if match else None


def _describe(exc: BaseException) -> str:
    """One line about a socket/HTTP failure that names no host, URL or credential."""
    if isinstance(exc, socket.gaierror):
        return "name not resolved"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, http.client.IncompleteRead):
        return "body cut short"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "closed without an answer"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return type(exc).__name__
