"""The DMTF redfish client's DEBUG log keeps no credential (fleet/bmc/redfish.py's filter)."""

from __future__ import annotations

import logging

import pytest

import fleet.bmc.redfish  # noqa: F401  (installs the filter)


def test_session_tokens_and_whole_passwords_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("redfish.rest.v1")
    with caplog.at_level(logging.DEBUG, logger="redfish.rest.v1"):
        logger.debug(
            'HTTP REQUEST (POST) for %s:\nHeaders:\n\tX-Auth-Token: %s\nBody: {"UserName": '
            '"admin", "Password": "pa\\"ss\\"word"}',
            "/redfish/v1/SessionService/Sessions",
            "tok-0123456789abcdef",
        )
        logger.debug("HTTP RESPONSE for %s: Code 200", "/redfish/v1/Systems")
    first, second = (r.getMessage() for r in caplog.records)
    assert "tok-0123456789abcdef" not in first and "ss" not in first.split("Password")[1]
    assert "X-Auth-Token: <REDACTED>" in first and '"Password": "<REDACTED>"' in first
    assert second == "HTTP RESPONSE for /redfish/v1/Systems: Code 200"  # the rest stays
