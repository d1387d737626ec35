"""The boot history (fleet/provisioning/boot_times.py) on both databases: every measured boot
kept for the retention, legacy per-server figures where the history has none, and the figure
planned with (a quantile plus a margin)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from factories import add_rack, add_server, add_site
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.models import BootRecord, Server
from fleet.provisioning.boot_times import (
    BootQuantile,
    boot_figures,
    boot_samples,
    measured_boots,
    record_boot,
)
from fleet.provisioning.placement import expected_boot_s

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def servers(session: Session) -> list[Server]:
    rack = add_rack(session, add_site(session, "lab"), "r1")
    out = [
        add_server(session, rack, f"gpu{i}", u_position=1 + 8 * i, bmc_port=8000 + i)
        for i in range(3)
    ]
    session.commit()
    return out


def test_every_boot_counts_not_only_each_servers_last(db: Engine, session: Session) -> None:
    a, b, legacy = servers(session)
    for seconds, hit in ((900.0, False), (960.0, False), (120.0, True), (1500.0, False)):
        record_boot(session, a, seconds, 60.0, hit, history_days=90, now=NOW)
    record_boot(session, b, 1000.0, 70.0, False, history_days=90, now=NOW)
    # A server with only the old per-server figure (measured before the history).
    legacy.boot_to_ready_s = legacy.boot_to_ready_uncached_s = 1100.0
    # A server with history rows: its per-server figures are not counted a second time.
    a.boot_to_ready_s = a.boot_to_ready_uncached_s = 1500.0
    session.add_all([a, legacy])
    session.commit()
    samples = sorted(boot_samples(session))
    model = a.gpu_model
    assert samples == sorted(
        [(model, False, s) for s in (900.0, 960.0, 1500.0, 1000.0, 1100.0)] + [(model, True, 120.0)]
    )
    assert sorted(s for _, s in measured_boots(session)) == [
        120.0,
        900.0,
        960.0,
        1000.0,
        1100.0,
        1500.0,
    ]
    figures = boot_figures(session, BootQuantile(quantile=0.9, margin_pct=10))
    seconds, basis = expected_boot_s(model, False, figures, 1200.0)
    assert seconds == pytest.approx(1500.0 * 1.1)  # five uncached boots: the slowest, + 10 %
    assert basis == f"{model}, version not cached: p90 + 10 % of 5 uncached boots"
    median = boot_figures(session, BootQuantile(quantile=0.5))
    assert expected_boot_s(model, False, median, 1200.0)[0] == 1000.0


def test_boots_older_than_the_retention_are_dropped_and_not_counted(
    db: Engine, session: Session
) -> None:
    a, _, _ = servers(session)
    record_boot(session, a, 2000.0, None, None, history_days=30, now=NOW - timedelta(days=40))
    record_boot(session, a, 900.0, None, None, history_days=30, now=NOW - timedelta(days=5))
    session.commit()
    # The second record dropped the first (35 days older than it); a read window of a day
    # leaves the second out as well.
    assert [r.boot_s for r in session.exec(select(BootRecord))] == [900.0]
    assert boot_samples(session, NOW - timedelta(days=1)) == []
    assert boot_samples(session, NOW - timedelta(days=10)) == [(a.gpu_model, None, 900.0)]
