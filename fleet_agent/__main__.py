"""`python -m fleet_agent`: run the agent from FLEET_AGENT_* environment variables."""

from __future__ import annotations

import logging
import sys

from pydantic import ValidationError

from fleet_agent.config import AgentSettings
from fleet_agent.main import run
from fleet_core.telemetry import TelemetryUnavailable


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = AgentSettings()  # every field from FLEET_AGENT_* variables

        run(settings)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "settings"
        print(f"agent: FLEET_AGENT_{where.upper()}: {first['msg']}", file=sys.stderr)
        return 2
    except TelemetryUnavailable as exc:
        print(f"agent: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
