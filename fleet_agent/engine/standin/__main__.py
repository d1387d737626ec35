"""`python -m fleet_agent.engine.standin <model> [trtllm-serve flags]` (see the package doc)."""

from __future__ import annotations

import sys

from fleet_agent.engine.standin.server import main

if __name__ == "__main__":
    sys.exit(main())
