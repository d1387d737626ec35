"""The web console (fleet/console/) over HTTP on both databases, as a browser and a hostile
client would talk to it: sign-in and its cookie, CSRF, who sees and may do what, escaping,
paging, the live fragments and the event stream. The elevation and power bars are plain data:
tested here without a service. The real-browser tests: tests/e2e/worlds/test_console_browser.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from factories import add_rack, add_server, add_site
from live import Live, serve
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from fleet.console.elevation import Box, elevation, power_bars
from fleet.models import Deployment, Event, Gpu, Role, Server

# ---------------------------------------------------------------------------------------------
# plain data


def test_the_elevation_runs_from_the_top_u_down_with_gaps_merged() -> None:
    boxes = elevation(
        10,
        [
            ("a", 1, 2, "serving", "8× H100", "llama"),
            ("b", 5, 4, "warm", "8× H100", None),
        ],
    )
    assert [(b.top, b.height, b.server, b.group) for b in boxes] == [
        (10, 2, None, "empty"),
        (8, 4, "b", "spare"),
        (4, 2, None, "empty"),
        (2, 2, "a", "serving"),
    ]
    assert sum(b.height for b in boxes) == 10


def test_a_server_past_the_top_or_over_another_is_cut_not_lost() -> None:
    boxes = elevation(4, [("tall", 3, 4, "failed", "", None), ("low", 1, 3, "booting", "", None)])
    assert boxes[0] == Box(4, 2, "tall", "failed", "fault", "", None)
    assert boxes[1].server == "low" and boxes[1].height == 2  # U3 is taken by "tall"
    assert sum(b.height for b in boxes) == 4


def test_a_rack_at_its_high_water_mark_is_hot() -> None:
    cool = power_bars(10_000, 8_000, 8_999, 90.0)
    hot = power_bars(10_000, 8_000, 9_000, 90.0)
    over = power_bars(10_000, 10_001, None, 90.0)
    assert not cool.hot and hot.hot and over.hot
    assert (hot.drawing_high, hot.over_budget) == (True, False)
    assert (over.drawing_high, over.over_budget) == (False, True)
    assert over.committed_bar == 100.0 and over.drawn_pct is None
    assert hot.drawn_pct == pytest.approx(90.0)


# ---------------------------------------------------------------------------------------------
# over HTTP


@pytest.fixture
def fleet(db: Engine, session: Session, tmp_path: Path) -> Iterator[Live]:
    site = add_site(session, "fra1")
    rack = add_rack(session, site, "fra1-r01")
    for i, (state, u) in enumerate((("serving", 1), ("warm", 9), (None, 17)), start=1):
        add_server(session, rack, f"gpu-0{i}", state, u_position=u, bmc_system_id=f"gpu-0{i}")
    with serve(db, tmp_path) as live:
        yield live


def browser(live: Live) -> httpx.Client:
    return httpx.Client(base_url=live.url, follow_redirects=False, timeout=30)


def server_event(subject: str, kind: str, message: str) -> Event:
    """An event about a server, as the feeds' tests write them."""
    return Event(
        subject_type="server", subject=subject, actor="t", kind=kind, message=message, details={}
    )


def newest_event_id(s: Session) -> int:
    """The newest event id (the fixture's own events are not the feeds' tests')."""
    return max((e.id or 0 for e in s.exec(select(Event))), default=0)


def login_form(client: httpx.Client, token: str) -> httpx.Response:
    """GET the sign-in form (its CSRF cookie and value), then POST `token` with it."""
    value = csrf(client.get("/ui/login").text)
    return client.post("/ui/login", data={"token": token, "csrf": value})


def sign_in(live: Live, role: Role) -> httpx.Client:
    client = browser(live)
    reply = login_form(client, live.token(role, name=f"{role.value}-1"))
    assert reply.status_code == 303 and reply.headers["location"] == "/ui/racks"
    return client


def csrf(page: str) -> str:
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match, "no CSRF field on the page"
    return match.group(1)


def test_signing_in_sets_a_cookie_no_script_or_other_site_can_use(fleet: Live) -> None:
    client = browser(fleet)
    assert client.get("/ui/racks").headers["location"] == "/ui/login"  # not signed in
    token = fleet.token(Role.VIEWER, name="v")
    reply = login_form(client, token)
    [cookie] = [c for c in reply.headers.get_list("set-cookie") if c.startswith("fleet_console=")]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert token not in cookie  # encrypted: the browser holds nothing it can read
    page = client.get("/ui/racks")
    assert page.status_code == 200 and "fra1-r01" in page.text
    assert token not in page.text and "viewer" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    # Signing out ends it.
    out = client.post("/ui/logout", data={"csrf": csrf(page.text)})
    assert out.status_code == 303 and client.get("/ui/racks").status_code == 303


def test_behind_a_tls_proxy_on_the_host_the_cookies_are_secure(fleet: Live) -> None:
    """A TLS-terminating proxy on the same host says https in X-Forwarded-Proto (uvicorn
    trusts it from 127.0.0.1 and ::1): the cookies are Secure. Plain http: they cannot be."""
    proxied = browser(fleet)
    proxied.headers["X-Forwarded-Proto"] = "https"
    form = proxied.get("/ui/login")
    assert all("Secure" in c for c in form.headers.get_list("set-cookie"))
    # The client speaks http to the proxy's upstream: it sends the form's Secure cookie by
    # hand, as the browser would over https.
    [pair] = [c.split(";")[0] for c in form.headers.get_list("set-cookie")]
    proxied.cookies.clear()
    signed = proxied.post(
        "/ui/login",
        data={"token": fleet.token(Role.VIEWER, name="p"), "csrf": csrf(form.text)},
        headers={"Cookie": pair},
    )
    assert signed.status_code == 303, signed.text
    assert all("Secure" in c for c in signed.headers.get_list("set-cookie")), signed.headers
    plain = browser(fleet).get("/ui/login")
    assert not any("Secure" in c for c in plain.headers.get_list("set-cookie"))


def test_bad_tokens_and_tokens_of_other_roles_do_not_sign_in(fleet: Live) -> None:
    client = browser(fleet)
    assert login_form(client, "flt_nope").status_code == 401
    assert login_form(client, "").status_code == 401
    router = fleet.token(Role.ROUTER, name="r")
    refused = login_form(client, router)
    assert refused.status_code == 403 and "cannot sign in" in refused.text
    # A sign-in posted from elsewhere (no form cookie, or a value not its own) signs nothing in.
    viewer = fleet.token(Role.VIEWER, name="v2")
    elsewhere = browser(fleet)
    forged = elsewhere.post("/ui/login", data={"token": viewer, "csrf": "x"})
    assert forged.status_code == 403 and "fleet_console=" not in forged.headers.get(
        "set-cookie", ""
    )
    # A forged or tampered cookie is no session.
    client.cookies.set("fleet_console", "gAAAAAforged", path="/ui")
    assert client.get("/ui/racks").status_code == 303


def test_a_revoked_token_ends_its_sessions(fleet: Live) -> None:
    client = sign_in(fleet, Role.OPERATOR)
    admin = fleet.client(fleet.token(Role.ADMIN, name="a"))
    tokens = admin.get("/api/v1/tokens").json()["results"]
    operator = next(t for t in tokens if t["name"] == "operator-1")
    assert admin.delete(f"/api/v1/tokens/{operator['id']}").status_code < 300
    assert client.get("/ui/racks").status_code == 303


def test_a_viewer_sees_no_action_and_a_forged_post_is_refused(fleet: Live, db: Engine) -> None:
    viewer = sign_in(fleet, Role.VIEWER)
    page = viewer.get("/ui/servers/gpu-01")
    assert page.status_code == 200 and "gpu-01" in page.text
    assert "/action" not in page.text and "Do it" not in page.text
    form = {"action": "drain", "reason": "x", "confirm": "yes", "csrf": csrf(page.text)}
    refused = viewer.post("/ui/servers/gpu-01/action", data=form)
    assert refused.status_code == 403 and "needs the operator role" in refused.text
    operator = sign_in(fleet, Role.OPERATOR)
    op_page = operator.get("/ui/servers/gpu-01").text
    # A post without the session's CSRF value, or with another session's, changes nothing.
    for value in ("", csrf(page.text), "x" * 43):
        bad = operator.post("/ui/servers/gpu-01/action", data={**form, "csrf": value})
        assert bad.status_code == 403 and "CSRF" in bad.text
    # Nor one without its confirmation or reason.
    good = {**form, "csrf": csrf(op_page)}
    assert (
        operator.post("/ui/servers/gpu-01/action", data={**good, "confirm": ""}).status_code == 400
    )
    assert (
        operator.post("/ui/servers/gpu-01/action", data={**good, "reason": " "}).status_code == 400
    )
    with Session(db) as s:
        assert s.exec(select(Server).where(Server.name == "gpu-01")).one().state == "serving"
    done = operator.post("/ui/servers/gpu-01/action", data={**good, "reason": "fans <b>loud</b>"})
    assert done.status_code == 303 and "Drain" in done.headers["location"]
    with Session(db) as s:
        assert s.exec(select(Server).where(Server.name == "gpu-01")).one().state == "draining"
        # The operator's, not the last row: the woken tick may record its own move meanwhile.
        mine = s.exec(
            select(Event).where(Event.subject == "gpu-01", Event.actor == "operator:operator-1")
        ).all()
    assert any("fans <b>loud</b>" in e.message for e in mine), [e.message for e in mine]
    shown = operator.get("/ui/servers/gpu-01").text
    assert "fans &lt;b&gt;loud&lt;/b&gt;" in shown and "fans <b>" not in shown


def test_an_operator_undrains_what_they_drained_and_a_move_that_cannot_be_is_said(
    fleet: Live, db: Engine
) -> None:
    operator = sign_in(fleet, Role.OPERATOR)
    form = {"reason": "bad cable", "confirm": "yes", "csrf": csrf(operator.get("/ui/racks").text)}

    def act(server: str, action: str) -> httpx.Response:
        return operator.post(f"/ui/servers/{server}/action", data={**form, "action": action})

    assert act("gpu-01", "drain").status_code == 303
    with Session(db) as s:
        drained = s.exec(select(Server).where(Server.name == "gpu-01")).one()
    # The API's drain: one the operator undrains (not the fleet's own), the tick woken.
    assert (drained.state, drained.drain_reason) == ("draining", "operator")
    undone = act("gpu-01", "undrain")
    assert undone.status_code == 303 and "Undrain" in undone.headers["location"]
    with Session(db) as s:
        again = s.exec(select(Server).where(Server.name == "gpu-01")).one()
        # By kind, not the last row: the woken tick records its own moves of gpu-01 meanwhile.
        undrains = s.exec(
            select(Event).where(Event.subject == "gpu-01", Event.kind == "server.undrain")
        ).all()
    assert again.drain_reason == "resume"  # loads again once drained
    messages = [e.message for e in undrains]
    assert len(messages) == 1 and "console: bad cable" in messages[0], messages
    # A warm spare neither drains nor undrains: 409, saying why, nothing changed.
    for action in ("drain", "undrain"):
        refused = act("gpu-02", action)
        assert refused.status_code == 409 and "gpu-02 is warm" in refused.text
    with Session(db) as s:
        assert s.exec(select(Server).where(Server.name == "gpu-02")).one().state == "warm"


def test_the_server_page_shows_each_gpus_readings_and_refreshes_them(
    fleet: Live, db: Engine
) -> None:
    with Session(db) as s:
        server = s.exec(select(Server).where(Server.name == "gpu-01")).one()
        assert server.id is not None
        for index in range(2):
            s.add(Gpu(server_id=server.id, index=index, model="H100", memory_mib=81559))
        s.commit()
    agent = fleet.client(fleet.token(Role.AGENT, name="agent-1", server="gpu-01"))

    def beat(temperature: float) -> None:
        sick = {"code": "xid_48", "gpu": 1, "message": "GPU 1: Xid 48 <DBE>"}
        body = {
            "server": "gpu-01",
            "verdict": "unhealthy",
            "action": "reboot",
            "reasons": [{**sick, "action": "reboot", "verdict": "unhealthy"}],
            "gpus": [
                {
                    "index": 0,
                    "health": "healthy",
                    "temperature_c": temperature,
                    "slowdown_temp_c": 87.0,
                    "power_w": 612.4,
                    "power_limit_w": 700.0,
                    "memory_used_mib": 71_000,
                    "memory_total_mib": 81_559,
                    "utilization_pct": 93.0,
                    "ecc_uncorrected_volatile": 0,
                    "remapped_rows_correctable": 0,
                    "remapped_rows_uncorrectable": 0,
                },
                {
                    "index": 1,
                    "health": "unhealthy",
                    "ecc_uncorrected_volatile": 3,
                    "remapped_rows_uncorrectable": 2,
                    "remap_failed": True,
                    "xids": [48, 63],
                },
            ],
        }
        assert agent.post("/api/v1/agent/heartbeat", json=body).status_code == 200

    beat(64.0)
    client = sign_in(fleet, Role.VIEWER)
    page = client.get("/ui/servers/gpu-01").text
    gpu0 = re.search(r'<tr data-gpu="0">(.*?)</tr>', page, re.S)
    gpu1 = re.search(r'<tr data-gpu="1">(.*?)</tr>', page, re.S)
    assert gpu0 is not None and gpu1 is not None
    assert "64 °C" in gpu0.group(1) and "612 W" in gpu0.group(1) and "69.3 / 80 GiB" in gpu0[1]
    # GPU 1 read no temperature: a dash, not a zero; its faults in numbers and its reason.
    assert "–" in gpu1[1] and "0 °C" not in gpu1[1]
    assert '<td class="num hot">3</td>' in gpu1[1] and "48, 63" in gpu1[1]
    assert "2 uncorr." in gpu1[1] and "failed" in gpu1[1]
    assert "Xid 48 &lt;DBE&gt;" in gpu1[1]
    # The live fragment carries them: a newer reading shows without a reload (on Postgres a
    # steady report's readings wait for the next batch: a fraction of a second).
    beat(88.0)
    deadline = time.monotonic() + 10
    while "88 °C" not in (fragment := client.get("/ui/servers/gpu-01/live").text):
        assert time.monotonic() < deadline, "the newer reading never showed"
        time.sleep(0.05)
    assert "<html" not in fragment
    hot = re.search(r'<tr data-gpu="0">(.*?)</tr>', fragment, re.S)
    assert hot is not None and '<td class="num hot">88 °C' in hot[1]  # past its slowdown


def test_lists_page_and_filter_in_the_database(fleet: Live) -> None:
    client = sign_in(fleet, Role.VIEWER)
    page = client.get("/ui/servers", params={"state": "warm"})
    assert page.status_code == 200 and "1 match" in page.text and "gpu-02" in page.text
    assert client.get("/ui/servers", params={"state": "bogus"}).status_code == 400
    assert "3 match" in client.get("/ui/servers").text


def test_the_live_fragments_and_the_event_stream(fleet: Live, db: Engine) -> None:
    client = sign_in(fleet, Role.VIEWER)
    racks = client.get("/ui/racks")
    live = re.search(r'data-live="([^"]+)"', racks.text)
    assert live is not None
    fragment = client.get(live.group(1).replace("&amp;", "&"))
    assert fragment.status_code == 200 and 'data-server="gpu-01"' in fragment.text
    assert "<html" not in fragment.text
    assert browser(fleet).get(live.group(1)).status_code == 401  # no session, no fragment
    assert client.get("/ui/racks/fra1-r01").status_code == 200
    assert client.get("/ui/racks/nope").status_code == 404
    with Session(db) as s:
        last = newest_event_id(s)
        s.add(server_event("gpu-02", "test.kind", "<script>alert(1)</script>"))
        s.commit()
    with client.stream("GET", "/ui/events/stream", params={"after": last}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        data = ""
        for line in stream.iter_lines():
            if line.startswith("data: "):
                data = line
                break
    assert "test.kind" in data and "&lt;script&gt;" in data and "<script>" not in data


def test_a_reconnecting_feed_goes_on_from_its_last_event_id(fleet: Live, db: Engine) -> None:
    """EventSource reconnects to the same URL (the page's `after`) with the last id it got in
    Last-Event-ID: the feed goes on from there instead of repeating every row since the page;
    a header that is not an id is ignored."""
    viewer = sign_in(fleet, Role.VIEWER)
    with Session(db) as s:
        after = newest_event_id(s)
        for n in range(3):
            s.add(server_event("gpu-01", "resume.test", f"event {n}"))
        s.commit()
        ids = [e.id for e in s.exec(select(Event).where(Event.kind == "resume.test"))]

    def first_data(headers: dict[str, str]) -> str:
        params: dict[str, str | int] = {"kind": "resume.test", "after": after}
        with viewer.stream(
            "GET", "/ui/events/stream", params=params, headers=headers, timeout=30
        ) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    return line
        return ""

    assert "event 0" in first_data({})
    assert "event 2" in first_data({"Last-Event-ID": str(ids[1])})
    assert "event 0" in first_data({"Last-Event-ID": "1; DROP TABLE event"})


def test_the_event_watch_reads_the_database_once_per_interval_whatever_the_callers() -> None:
    import asyncio

    from fleet.console.event_watch import EventWatch

    visible = list(range(1, 8))
    clock = [0.0]
    watch = EventWatch(
        lambda: visible[-1],
        lambda after, limit: [i for i in visible if i > after][:limit],
        poll_s=1.0,
        clock=lambda: clock[0],
    )

    async def many() -> list[int]:
        return list(await asyncio.gather(*(watch.newest() for _ in range(50))))

    async def scenario() -> None:
        assert await many() == [7] * 50 and watch.reads == 1
        visible.extend([8, 9])
        clock[0] = 0.5  # within the interval: the answer is the last read's
        assert await many() == [7] * 50 and watch.reads == 1
        clock[0] = 1.0
        assert await many() == [9] * 50 and watch.reads == 2

    asyncio.run(scenario())


def test_the_event_watch_waits_at_an_id_committed_late_and_passes_a_rolled_back_one() -> None:
    """Ids become visible out of order on Postgres (a sequence hands them out at insert; the
    transactions commit in any order): the watch stops below a gap until it fills, and passes
    a gap still there after the grace (an id rolled back is never filled)."""
    import asyncio

    from fleet.console import event_watch
    from fleet.console.event_watch import EventWatch

    visible = [10]
    clock = [0.0]
    watch = EventWatch(
        lambda: visible[-1],
        lambda after, limit: sorted(i for i in visible if i > after)[:limit],
        poll_s=1.0,
        clock=lambda: clock[0],
        grace_s=5.0,
    )

    def at(t: float) -> int:
        clock[0] = t
        return asyncio.run(watch.newest())

    assert at(0.0) == 10
    visible += [11, 13, 14]  # 12 is still in its transaction
    assert at(1.0) == 11
    assert at(2.0) == 11  # waiting for 12
    visible.append(12)  # it commits: the watch goes on past it
    assert at(3.0) == 14
    visible += [16, 17]  # 15 was rolled back: never visible
    assert at(4.0) == 14
    assert at(8.0) == 14  # 4 s: still waited for
    assert at(9.0) == 17  # 5 s: given up
    assert watch._gaps == {}  # nothing kept for gaps passed or filled
    # A poll reads on while its reads come back full (a burst of events)
    visible += list(range(18, 18 + 2 * event_watch.READ_LIMIT + 5))
    reads = watch.reads
    assert at(10.0) == visible[-1] and watch.reads - reads == 3


@pytest.mark.parametrize(
    "engine", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True
)
def test_an_open_feed_gets_an_event_whose_transaction_commits_after_a_later_ones(
    fleet: Live, db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Postgres: event A takes its id, event B the next one and commits first. A feed that
    went on from B's id never sent A (seen and left in earlier stops); it now waits at A's id
    and sends both, A first."""
    import threading

    from fleet.console import routes

    monkeypatch.setattr(routes, "STREAM_POLL_S", 0.1)
    viewer = sign_in(fleet, Role.VIEWER)
    got: list[str] = []
    with Session(db) as s:
        after = newest_event_id(s)

    def follow() -> None:
        params: dict[str, str | int] = {"kind": "late.test", "after": after}
        with viewer.stream("GET", "/ui/events/stream", params=params, timeout=30) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    got.append(line)
                    if len(got) == 2:
                        return

    feed = threading.Thread(target=follow, daemon=True)
    feed.start()
    time.sleep(0.5)
    with Session(db) as early, Session(db) as late:
        a = server_event("gpu-01", "late.test", "first in, last to commit")
        early.add(a)
        early.flush()  # A has its id; its transaction stays open
        b = server_event("gpu-01", "late.test", "second in, first to commit")
        late.add(b)
        late.commit()
        late.refresh(b)
        assert a.id is not None and b.id is not None and a.id < b.id
        time.sleep(1.0)  # the feed polls ~10 times while A is not visible
        assert got == []  # B waits behind A's gap
        early.commit()
    feed.join(timeout=10)
    assert len(got) == 2, got
    assert "first in, last to commit" in got[0] and "second in, first to commit" in got[1]


def test_open_event_streams_share_one_poll_and_a_revoked_one_ends(
    fleet: Live, db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three open feeds cost one newest-id read per interval between them, each still gets
    its own events; a feed whose token is revoked ends at its next sign-in check."""
    import threading

    from fleet.console import routes

    monkeypatch.setattr(routes, "STREAM_POLL_S", 0.1)
    monkeypatch.setattr(routes, "STREAM_RECHECK_S", 0.5)
    viewer = sign_in(fleet, Role.VIEWER)
    got: dict[str, list[str]] = {"gpu-01": [], "gpu-02": [], "": []}
    ended: dict[str, float] = {}

    with Session(db) as s:  # the fixture's own events are not this test's
        after = newest_event_id(s)

    def follow(subject: str) -> None:
        params: dict[str, str | int] = {"subject": subject, "after": after}
        with viewer.stream("GET", "/ui/events/stream", params=params, timeout=30) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    got[subject].append(line)
        ended[subject] = time.monotonic()

    feeds = [threading.Thread(target=follow, args=(s,), daemon=True) for s in got]
    for t in feeds:
        t.start()
    time.sleep(0.5)
    watch = fleet.app.state.event_watch
    reads_before, started = watch.reads, time.monotonic()
    with Session(db) as s:
        for subject in ("gpu-01", "gpu-02"):
            s.add(server_event(subject, "test.kind", f"about {subject}"))
        s.commit()
    time.sleep(1.0)
    reads = watch.reads - reads_before
    assert all(len(lines) == 1 for subject, lines in got.items() if subject), got
    assert len(got[""]) == 2 and all("test.kind" in line for line in got[""])
    assert all(f"about {subject}" in got[subject][0] for subject in ("gpu-01", "gpu-02"))
    # One read per 0.1 s interval at most, for three feeds (each of its own: three a poll)
    assert reads <= (time.monotonic() - started) / 0.1 + 2, reads

    admin = fleet.client(fleet.token(Role.ADMIN, name="a"))
    tokens = admin.get("/api/v1/tokens").json()["results"]
    mine = next(t for t in tokens if t["name"] == "viewer-1")
    revoked = time.monotonic()
    assert admin.delete(f"/api/v1/tokens/{mine['id']}").status_code < 300
    for t in feeds:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in feeds), "a revoked token's feed went on"
    assert max(ended.values()) - revoked < 5.0


def test_a_chart_breaks_at_missing_minutes_and_counts_minutes_over_its_limit() -> None:
    from fleet.console.charts import HEIGHT, line_chart

    nan = float("nan")
    points = [(0.0, 1.0), (60.0, 2.0), (120.0, nan), (180.0, 3.0), (240.0, 4.0)]
    chart = line_chart(points, 0.0, 240.0, limit=2.5)
    assert len(chart.lines) == 2  # the gap at 120 s splits the line
    assert chart.last == 4.0 and chart.peak == 4.0 and chart.over == 2
    assert chart.limit_y == pytest.approx(HEIGHT - 2.5 / 4.0 * HEIGHT)
    empty = line_chart([], 0.0, 60.0, limit=1.0)
    assert empty.lines == [] and empty.last is None and empty.top == 1.25


def chat(s: Session) -> Deployment:
    """A deployment `chat` (SLA p95 2 s, TTFT 0.5 s), committed."""
    dep = Deployment(
        name="chat",
        model_uri="s3://m/x",
        model_checksum="sha256:1",
        gpus_per_replica=8,
        sla_p95_latency_ms=2000,
        sla_ttft_ms=500,
    )
    s.add(dep)
    s.commit()
    return dep


def test_the_deployments_page_draws_its_history_and_calendar(fleet: Live, db: Engine) -> None:
    from datetime import UTC, datetime

    from fleet.autoscaler import demand
    from fleet.models import DemandHour, ScheduleEntry

    with Session(db) as s:
        dep = chat(s)
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        s.add(
            DemandHour(
                deployment="chat",
                hour=hour,
                requests=demand.pack([120.0] * 60),
                tokens=demand.pack([0.0] * 60),
                servers=demand.pack([1.0] * 60),
                slot_use=demand.pack([0.5] * 60),
                p95_s=demand.pack([3.0] * 60),
                ttft_p95_s=demand.pack([0.1] * 60),
            )
        )
        s.add(
            ScheduleEntry(
                deployment_id=dep.id or 0,
                cron="0 9 * * 1-5",
                timezone="Europe/Berlin",
                min_replicas=2,
                duration_s=3600,
                created_by="t",
            )
        )
        s.commit()
    page = sign_in(fleet, Role.VIEWER).get("/ui/deployments").text
    assert "Requests a minute (3 h): now 120" in page
    assert "p95 latency against the SLA (3 h): now 3 s" in page and "minutes over" in page
    assert "Calendar: at least 2 replicas from" in page and "Europe/Berlin" in page


def test_servers_filter_by_deployment_and_health_in_the_api_and_the_console(
    fleet: Live, db: Engine
) -> None:
    from fleet.models import Verdict

    with Session(db) as s:
        dep = chat(s)
        one = s.exec(select(Server).where(Server.name == "gpu-01")).one()
        one.deployment_id, one.health_verdict = dep.id, Verdict.DEGRADED
        s.add(one)
        s.commit()
    api = fleet.client(fleet.token(Role.VIEWER, name="api"))
    by_dep = api.get("/api/v1/servers", params={"deployment": "chat"}).json()
    assert [r["name"] for r in by_dep["results"]] == ["gpu-01"]
    assert api.get("/api/v1/servers", params={"deployment": "nope"}).json()["count"] == 0
    by_health = api.get("/api/v1/servers", params={"health": "degraded"}).json()
    assert [r["name"] for r in by_health["results"]] == ["gpu-01"]
    assert api.get("/api/v1/servers", params={"health": "sick"}).status_code == 422
    client = sign_in(fleet, Role.VIEWER)
    page = client.get("/ui/servers", params={"deployment": "chat", "health": "degraded"})
    assert "1 match" in page.text and "gpu-01" in page.text
    assert client.get("/ui/servers", params={"health": "sick"}).status_code == 400


def test_a_power_action_goes_through_the_fleets_power_path_and_says_how_it_went(
    fleet: Live,
) -> None:
    operator = sign_in(fleet, Role.OPERATOR)
    form = {
        "action": "power_on",
        "reason": "console test",
        "confirm": "yes",
        "csrf": csrf(operator.get("/ui/servers/gpu-02").text),
    }
    # No BMC listens at the server's endpoint here: the fleet's power path says so.
    done = operator.post("/ui/servers/gpu-02/action", data=form)
    assert done.status_code == 303
    shown = operator.get(done.headers["location"]).text
    assert "Power on: failed:" in shown and "gpu-02" in shown
