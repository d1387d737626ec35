"""s3:// for the weights fetcher: settings and AWS Signature Version 4 with the stdlib.

Any S3-compatible store (AWS, MinIO, Ceph RGW, moto in the tests): a GET of one object, signed
with hmac/hashlib, sent by the fetcher's own HTTP client (fetch_http.py), so the agent carries
no boto3. Path-style addressing by default (`<endpoint>/<bucket>/<key>`: what on-prem stores
answer to); virtual-hosted style (`<bucket>.<endpoint host>/<key>`) when `path_style` is off.
Without an access key the request goes unsigned (a public bucket).

The secret key is a SecretStr: it is used to derive the signing key and never appears in a
message, a log line or a repr.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr

# sha256 of an empty body: what a GET signs as its payload hash.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
ALGORITHM = "AWS4-HMAC-SHA256"


class S3Settings(BaseModel):
    """Where s3:// URIs are fetched from, and as whom. The agent builds it from
    FLEET_AGENT_S3_* (`from_env` reads those, with the AWS_* names as fallback)."""

    model_config = ConfigDict(frozen=True)

    endpoint_url: str = Field(pattern=r"^https?://[^/?#@\s]+/?$")
    region: str = Field(default="us-east-1", min_length=1, max_length=64)
    access_key_id: str | None = Field(default=None, min_length=1, max_length=256)
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None  # temporary credentials (STS)
    path_style: bool = True

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, prefix: str = "FLEET_AGENT_S3_"
    ) -> S3Settings | None:
        """From `<prefix>ENDPOINT_URL`, `REGION`, `ACCESS_KEY_ID`, `SECRET_ACCESS_KEY`,
        `SESSION_TOKEN`, `PATH_STYLE`; each falls back to its AWS_* name (AWS_ENDPOINT_URL_S3,
        AWS_ENDPOINT_URL, AWS_REGION, AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, ...). None: no
        endpoint configured (s3:// URIs then fail with UnknownScheme's sibling, a FetchError)."""
        env = os.environ if environ is None else environ

        def pick(name: str, *fallbacks: str) -> str | None:
            for key in (prefix + name, *fallbacks):
                value = env.get(key)
                if value:
                    return value
            return None

        endpoint = pick("ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        if endpoint is None:
            return None
        secret = pick("SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY")
        token = pick("SESSION_TOKEN", "AWS_SESSION_TOKEN")
        return cls(
            endpoint_url=endpoint,
            region=pick("REGION", "AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
            access_key_id=pick("ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
            secret_access_key=SecretStr(secret) if secret else None,
            session_token=SecretStr(token) if token else None,
            path_style=(pick("PATH_STYLE") or "true").lower() not in ("0", "false", "no"),
        )


@dataclass(frozen=True)
class S3Request:
    """One object's GET as the HTTP client sends it: the URL (no credentials in it) and the
    headers to add, Authorization included when signed."""

    url: str
    headers: dict[str, str]


def split_s3_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/key → (bucket, key). ValueError when either is missing."""
    parts = urlsplit(uri)
    bucket, key = parts.netloc, parts.path.lstrip("/")
    if parts.scheme != "s3" or not bucket or not key or parts.query or "@" in bucket:
        raise ValueError("not an s3://bucket/key URI")
    return bucket, key


def object_request(
    settings: S3Settings,
    uri: str,
    extra_headers: Mapping[str, str] | None = None,
    now: dt.datetime | None = None,
) -> S3Request:
    """The GET of `uri` (s3://bucket/key) against `settings.endpoint_url`, signed when an
    access key is set. `extra_headers` (e.g. Range) are sent and signed."""
    bucket, key = split_s3_uri(uri)
    endpoint = urlsplit(settings.endpoint_url)
    base_path = endpoint.path.rstrip("/")
    encoded_key = quote(key, safe="/-_.~")
    if settings.path_style:
        host = endpoint.netloc
        path = f"{base_path}/{quote(bucket, safe='-_.~')}/{encoded_key}"
    else:
        host = f"{bucket}.{endpoint.netloc}"
        path = f"{base_path}/{encoded_key}"
    headers = dict(extra_headers or {})
    if settings.access_key_id and settings.secret_access_key is not None:
        headers = sign_v4(
            method="GET",
            host=host,
            path=path,
            query="",
            headers=headers,
            payload_sha256=EMPTY_SHA256,
            access_key_id=settings.access_key_id,
            secret_access_key=settings.secret_access_key.get_secret_value(),
            region=settings.region,
            service="s3",
            now=now or dt.datetime.now(dt.UTC),
            session_token=(
                settings.session_token.get_secret_value() if settings.session_token else None
            ),
        )
    return S3Request(url=f"{endpoint.scheme}://{host}{path}", headers=headers)


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signing_key(secret_access_key: str, date: str, region: str, service: str) -> bytes:
    """SigV4's derived key: HMAC chain over the date (YYYYMMDD), region, service."""
    k_date = _hmac(("AWS4" + secret_access_key).encode(), date)
    return _hmac(_hmac(_hmac(k_date, region), service), "aws4_request")


def sign_v4(
    *,
    method: str,
    host: str,
    path: str,
    query: str,
    headers: Mapping[str, str],
    payload_sha256: str,
    access_key_id: str,
    secret_access_key: str,
    region: str,
    service: str,
    now: dt.datetime,
    session_token: str | None = None,
) -> dict[str, str]:
    """`headers` plus Host, x-amz-date, x-amz-content-sha256 (and x-amz-security-token) and
    the Authorization header of AWS Signature Version 4 (header-based). `path` and `query`
    are already URI-encoded as they go on the wire (S3 signs the path as sent, no double
    encoding); every header given is signed."""
    amz_date = now.astimezone(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    date = amz_date[:8]
    out = dict(headers)
    out["Host"] = host
    out["x-amz-date"] = amz_date
    out["x-amz-content-sha256"] = payload_sha256
    if session_token:
        out["x-amz-security-token"] = session_token
    canonical = {k.lower(): " ".join(str(v).split()) for k, v in out.items()}
    signed = ";".join(sorted(canonical))
    canonical_request = "\n".join(
        [
            method,
            path or "/",
            query,
            "".join(f"{k}:{canonical[k]}\n" for k in sorted(canonical)),
            signed,
            payload_sha256,
        ]
    )
    scope = f"{date}/{region}/{service}/aws4_request"
    string_to_sign = "\n".join(
        [ALGORITHM, amz_date, scope, hashlib.sha256(canonical_request.encode()).hexdigest()]
    )
    key = signing_key(secret_access_key, date, region, service)
    signature = hmac.new(key, string_to_sign.encode(), hashlib.sha256).hexdigest()
    out["Authorization"] = (
        f"{ALGORITHM} Credential={access_key_id}/{scope}, SignedHeaders={signed}, "
        f"Signature={signature}"
    )
    return out
