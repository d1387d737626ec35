"""How `./run test` spreads the suite over pytest-xdist workers.

The modules in ONE_AT_A_TIME run a whole world in real processes (a service, a colo of
emulated BMCs, agents, engines, a router) and watch it in real time. Their tests form one
unit of work: they run one after another on one worker while the other workers take the rest,
test by test. Two of them at once would share this machine's two cores with each other's
control loops, and their waits are sized for one.

This is xdist's `loadgroup` with the group decided here, from the node id, rather than by an
`xdist_group` mark: loadgroup carries the mark by rewriting node ids, which pytest 9.2's
structured ids no longer allow (pytest-xdist issue #1386), so the mark is silently ignored.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

ONE_AT_A_TIME = frozenset(
    {
        "test_agent_daemon.py",
        "test_autoscaler_e2e.py",
        "test_calendar_e2e.py",
        "test_demo.py",
        "test_lab.py",
        "test_leader.py",
        "test_load.py",
        "test_prometheus.py",
        "test_provisioning_e2e.py",
        "test_schemathesis.py",
        "test_secrets.py",
        "test_tls.py",
    }
)
GROUP = "one-at-a-time"


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: GROUP, or the test alone."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return GROUP if module in ONE_AT_A_TIME else nodeid


class OneAtATimeScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """LoadScopeScheduling (units of work handed out as workers free up) with scope_of's
    units."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)
