"""Encryption at rest for BMC credentials (Fernet: AES-128-CBC + HMAC-SHA256)."""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken


class SecretBox:
    def __init__(self, key: bytes) -> None:
        try:
            self._fernet = Fernet(key)
        except (ValueError, TypeError) as exc:
            raise ValueError(
                "the secret key is not a valid Fernet key (32 url-safe base64-encoded bytes)"
            ) from exc

    def encrypt(self, plaintext: str) -> str:
        return self._fernet.encrypt(plaintext.encode()).decode()

    def decrypt_within(self, ciphertext: str, ttl_s: int) -> str | None:
        """The plaintext of something this box encrypted less than `ttl_s` ago; None when it
        is older, forged or from another key (a console session: fleet/console/session.py)."""
        try:
            return self._fernet.decrypt(ciphertext.encode(), ttl=ttl_s).decode()
        except (InvalidToken, ValueError):
            return None

    def decrypt(self, ciphertext: str) -> str:
        try:
            return self._fernet.decrypt(ciphertext.encode()).decode()
        except InvalidToken as exc:
            raise ValueError(
                "cannot decrypt a stored credential: FLEET_SECRET_KEY differs from the key "
                "it was written with"
            ) from exc
