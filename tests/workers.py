"""How `./run test` spreads the suite over pytest-xdist workers, keyed on a test's folder.

- tests/unit/: no processes of their own (SQLite and Postgres, the ASGI app in-process): spread
  test by test.
- tests/e2e/: real peers (BMC emulators, engine stand-ins, a router, a service as a child):
  each module is one unit of work, so its peers start once per worker.
- tests/e2e/worlds/ and tests/chaos/: a whole world in real processes (a service, a colo of
  emulated BMCs, agents, engines, a router) watched in real time. Together they form one unit
  of work: they run one after another on one worker while the other workers take the rest.
  Two of them at once would share this machine's two cores with each other's control loops,
  and their waits are sized for one.

This is xdist's `loadgroup` with the group decided here, from the node id's folder, rather than
by an `xdist_group` mark: loadgroup carries the mark by rewriting node ids, which pytest 9.2's
structured ids no longer allow (pytest-xdist issue #1386), so the mark is silently ignored.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

E2E_FOLDER = "e2e"
WORLDS_FOLDER = "worlds"
CHAOS_FOLDER = "chaos"  # worlds with faults injected: as heavy, and as sensitive to a busy CPU
GROUP = "one-at-a-time"


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: GROUP (tests/e2e/worlds/, tests/chaos/), its module
    (tests/e2e/), or the test alone (tests/unit/)."""
    path = nodeid.split("::", 1)[0]
    *folders, _module = path.split("/")
    if WORLDS_FOLDER in folders or CHAOS_FOLDER in folders:
        return GROUP
    if E2E_FOLDER in folders:
        return path
    return nodeid


class OneAtATimeScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """LoadScopeScheduling (units of work handed out as workers free up) with scope_of's
    units."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)
