"""fleet.placement: which warm spares boot (and which servers are released), table-tested.

The numbers are an 8 × H100 server's: 10,200 W at max, 60 W standby, so a boot commits
10,140 W more.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.provisioning.placement import (
    BootFigures,
    Choice,
    RackRoom,
    Serving,
    Spare,
    Want,
    choose_release,
    choose_spares,
    expected_boot_s,
    extra_draw_w,
    fits,
    holds,
    spare_boot_s,
    why,
)

EXTRA = 10_140.0  # 10,200 max - 60 standby
ROOMY = 1_000_000.0


def spare(
    name: str,
    rack: str = "r1",
    *,
    site: str = "fra1",
    gpu_model: str = "H100",
    gpu_count: int = 8,
    standby_w: float = 60.0,
    max_w: float = 10_200.0,
    cached: tuple[str, ...] = (),
    boot_s: float | None = None,
) -> Spare:
    return Spare(name, site, rack, gpu_model, gpu_count, standby_w, max_w, cached, boot_s)


def room(
    rack: str, headroom_w: float = ROOMY, *, site: str = "fra1", sides: tuple[str, ...] = ("A", "B")
) -> RackRoom:
    return RackRoom(rack, site, headroom_w, sides)


def rooms(*items: RackRoom) -> dict[str, RackRoom]:
    return {r.rack: r for r in items}


def want(
    servers: int = 1,
    *,
    gpu_models: tuple[str, ...] = (),
    gpus_per_replica: int = 8,
    running: Mapping[str, int] | None = None,
    site: str | None = None,
    model: str = "s3://models/llama-70b",
) -> Want:
    return Want("chat", model, gpu_models, gpus_per_replica, servers, running or {}, site)


def serving(
    name: str,
    rack: str,
    in_flight: int = 0,
    *,
    deployment: str = "chat",
    max_w: float = 10_200.0,
    standby_w: float = 60.0,
) -> Serving:
    return Serving(name, rack, deployment, in_flight, max_w, standby_w)


# --- helpers ------------------------------------------------------------------------------------


def test_extra_draw_is_max_less_standby() -> None:
    assert extra_draw_w(spare("s1")) == EXTRA
    assert extra_draw_w(serving("s1", "r1")) == EXTRA
    # A record with standby above max frees nothing by booting (never a negative draw).
    assert extra_draw_w(spare("s1", standby_w=500, max_w=400)) == 0.0


@pytest.mark.parametrize(
    ("headroom_w", "already_w", "expected"),
    [
        (EXTRA, 0.0, True),  # exact fit
        (EXTRA - 1, 0.0, False),  # 1 W short
        (2 * EXTRA, EXTRA, True),  # the second boot in a rack, exactly
        (2 * EXTRA - 1, EXTRA, False),
        (-100.0, 0.0, False),  # already over budget
    ],
)
def test_fits(headroom_w: float, already_w: float, expected: bool) -> None:
    assert fits(spare("s1"), room("r1", headroom_w), already_w=already_w) is expected


def test_fits_refuses_another_racks_room() -> None:
    with pytest.raises(ValueError, match="rack r1, not r2"):
        fits(spare("s1", "r1"), room("r2"))


# --- eligibility --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_models", "expected"),
    [
        (("H100",), ("h100",)),
        (("H100", "H200"), ("h100", "h200")),
        (("L40S",), ("l40s",)),
        ((), ("h100", "h200", "l40s")),  # empty: any model
        (("B200",), ()),
    ],
)
def test_gpu_model_filter(gpu_models: tuple[str, ...], expected: tuple[str, ...]) -> None:
    spares = [
        spare("h100", "r1", gpu_model="H100"),
        spare("h200", "r2", gpu_model="H200"),
        spare("l40s", "r3", gpu_model="L40S"),
    ]
    choice = choose_spares(
        spares, rooms(room("r1"), room("r2"), room("r3")), want(3, gpu_models=gpu_models)
    )
    assert sorted(choice.chosen) == list(expected)
    assert choice.short == 3 - len(expected)


@pytest.mark.parametrize(
    ("gpu_count", "per_replica", "eligible"),
    [(8, 8, True), (4, 8, False), (8, 4, True), (1, 1, True), (2, 4, False)],
)
def test_gpu_count_filter(gpu_count: int, per_replica: int, eligible: bool) -> None:
    choice = choose_spares(
        [spare("s1", gpu_count=gpu_count)], rooms(room("r1")), want(gpus_per_replica=per_replica)
    )
    assert choice.chosen == (("s1",) if eligible else ())


def test_site_restriction() -> None:
    spares = [spare("ams-1", "ams-r1", site="ams1"), spare("fra-1", "fra-r1", site="fra1")]
    racks = rooms(room("ams-r1", site="ams1"), room("fra-r1", site="fra1"))
    assert choose_spares(spares, racks, want(2, site="fra1")) == Choice(
        ("fra-1",),
        1,
        ("1 warm spare outside site fra1 (ams1: 1)", "only 1 warm spare in site fra1, 2 wanted"),
    )
    assert sorted(choose_spares(spares, racks, want(2)).chosen) == ["ams-1", "fra-1"]


# --- power --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headroom_w", "chosen", "reasons"),
    [
        (EXTRA, ("s1",), ()),
        (EXTRA + 0.5, ("s1",), ()),
        (
            EXTRA - 1,
            (),
            ("rack r1: 10,139 W headroom, a spare needs 10,140 W more (10,200 max - 60 standby)",),
        ),
        (
            1_234,
            (),
            ("rack r1: 1,234 W headroom, a spare needs 10,140 W more (10,200 max - 60 standby)",),
        ),
        (
            EXTRA - 0.04,  # headroom rounds down, need up: never looks like it fits
            (),
            (
                "rack r1: 10,139.9 W headroom, a spare needs 10,140 W more "
                "(10,200 max - 60 standby)",
            ),
        ),
        (
            -500,
            (),
            ("rack r1: -500 W headroom, a spare needs 10,140 W more (10,200 max - 60 standby)",),
        ),
    ],
)
def test_headroom_exact_fit_and_short(
    headroom_w: float, chosen: tuple[str, ...], reasons: tuple[str, ...]
) -> None:
    choice = choose_spares([spare("s1")], rooms(room("r1", headroom_w)), want())
    assert choice == Choice(chosen, 1 - len(chosen), reasons)


@pytest.mark.parametrize(
    ("headroom_w", "booted"),
    [(2 * EXTRA, 2), (2 * EXTRA - 1, 1), (3 * EXTRA, 3), (EXTRA - 1, 0)],
)
def test_picks_in_one_rack_consume_its_headroom(headroom_w: float, booted: int) -> None:
    spares = [spare("s1"), spare("s2"), spare("s3")]
    choice = choose_spares(spares, rooms(room("r1", headroom_w)), want(3))
    assert len(choice.chosen) == booted
    assert choice.short == 3 - booted


def test_second_pick_in_a_rack_does_not_fit_and_says_so() -> None:
    choice = choose_spares([spare("s1"), spare("s2")], rooms(room("r1", 15_000)), want(2))
    assert choice == Choice(
        ("s1",),
        1,
        (
            "rack r1: 4,860 W headroom left after 1 chosen here, a spare needs 10,140 W more "
            "(10,200 max - 60 standby)",
        ),
    )


def test_power_reason_names_the_smallest_need_of_several_spares() -> None:
    spares = [spare("big", max_w=12_060), spare("small", max_w=8_060), spare("mid", max_w=10_060)]
    choice = choose_spares(spares, rooms(room("r1", 5_000)), want(1))
    assert choice.reasons == (
        "rack r1: 5,000 W headroom, 3 spares need 8,000 W or more each (8,060 max - 60 standby)",
    )


def test_a_spare_in_a_rack_without_power_figures_never_boots() -> None:
    choice = choose_spares([spare("s1", "r9"), spare("s2", "r9")], {}, want(1))
    assert choice == Choice(
        (), 1, ("rack r9: no power figures (headroom unknown), 2 warm spares not booted",)
    )


def test_a_rack_that_does_not_fit_is_skipped_for_one_that_does() -> None:
    spares = [
        spare("tight", "r1", cached=("s3://models/llama-70b",), boot_s=60),
        spare("free", "r2"),
    ]
    choice = choose_spares(spares, rooms(room("r1", 5_000), room("r2")), want(1))
    assert choice == Choice(("free",), 0, ())


# --- preferences --------------------------------------------------------------------------------

URI = "s3://models/llama-70b"


def test_cached_model_first_even_against_spread_and_boot_time() -> None:
    spares = [
        spare("fast-empty-rack", "r2", boot_s=60),
        spare("cached-busy-rack", "r1", cached=("s3://other", URI), boot_s=600),
    ]
    choice = choose_spares(spares, rooms(room("r1"), room("r2")), want(1, running={"r1": 5}))
    assert choice.chosen == ("cached-busy-rack",)


def test_a_different_cached_model_counts_for_nothing() -> None:
    spares = [
        spare("other", "r1", cached=("s3://other",), boot_s=600),
        spare("fast", "r2", boot_s=60),
    ]
    assert choose_spares(spares, rooms(room("r1"), room("r2")), want(1)).chosen == ("fast",)


@pytest.mark.parametrize(
    ("running", "servers", "expected"),
    [
        ({}, 2, ("r1-a", "r2-a")),  # one per rack, not both of r1's (faster) spares
        ({"r1": 1}, 1, ("r2-a",)),
        ({"r1": 1}, 3, ("r2-a", "r1-a", "r2-b")),
        ({"r2": 3}, 3, ("r1-a", "r1-b", "r2-a")),
        ({"r2": 1, "elsewhere": 9}, 2, ("r1-a", "r1-b")),
    ],
)
def test_spread_across_racks(
    running: Mapping[str, int], servers: int, expected: tuple[str, ...]
) -> None:
    spares = [
        spare("r1-a", "r1", boot_s=100),
        spare("r1-b", "r1", boot_s=110),
        spare("r2-a", "r2", boot_s=200),
        spare("r2-b", "r2", boot_s=210),
    ]
    choice = choose_spares(spares, rooms(room("r1"), room("r2")), want(servers, running=running))
    assert choice.chosen == expected


def test_spread_across_sites_after_racks() -> None:
    # a1 already runs one; a2 and b1 run none. Site a has one, site b none: b1 wins,
    # though a2's spare boots faster.
    spares = [spare("a2-s", "a2", site="a", boot_s=60), spare("b1-s", "b1", site="b", boot_s=600)]
    racks = rooms(room("a1", site="a"), room("a2", site="a"), room("b1", site="b"))
    assert choose_spares(spares, racks, want(1, running={"a1": 1})).chosen == ("b1-s",)


def test_a_rack_fed_from_both_sides_before_one_fed_from_one() -> None:
    spares = [spare("one-side", "r1", boot_s=60), spare("two-sides", "r2", boot_s=600)]
    racks = rooms(room("r1", sides=("A",)), room("r2", sides=("A", "B")))
    assert choose_spares(spares, racks, want(1)).chosen == ("two-sides",)


def test_fastest_measured_boot_first_and_unmeasured_last() -> None:
    spares = [
        spare("never", "r1"),
        spare("slow", "r2", boot_s=900),
        spare("fast", "r3", boot_s=120),
        spare("mid", "r4", boot_s=300),
    ]
    racks = rooms(room("r1"), room("r2"), room("r3"), room("r4"))
    assert choose_spares(spares, racks, want(4)).chosen == ("fast", "mid", "slow", "never")


@pytest.mark.parametrize("slow_s", [600.0, 3_600.0, 1e9])
def test_unmeasured_boot_after_any_measured_one(slow_s: float) -> None:
    spares = [spare("a-never", "r1"), spare("b-slow", "r2", boot_s=slow_s)]
    assert choose_spares(spares, rooms(room("r1"), room("r2")), want(1)).chosen == ("b-slow",)


def test_most_headroom_left_after_the_boot() -> None:
    spares = [spare("a", "r1"), spare("b", "r2"), spare("c", "r3", max_w=5_060)]
    racks = rooms(room("r1", 20_000), room("r2", 30_000), room("r3", 20_000))
    # Left after: a 9,860; b 19,860; c 15,000.
    assert choose_spares(spares, racks, want(3)).chosen == ("b", "c", "a")


def test_name_breaks_the_last_tie() -> None:
    spares = [spare("s3", "r3"), spare("s1", "r1"), spare("s2", "r2")]
    racks = rooms(room("r1"), room("r2"), room("r3"))
    assert choose_spares(spares, racks, want(3)).chosen == ("s1", "s2", "s3")


def _fleet() -> tuple[list[Spare], dict[str, RackRoom], Want]:
    spares = [
        spare(
            f"s{i:02d}",
            f"r{i % 4}",
            site="ams1" if i % 4 == 3 else "fra1",
            gpu_model=("H100", "H200", "L40S")[i % 3],
            cached=(URI,) if i % 5 == 0 else (),
            boot_s=None if i % 7 == 0 else float(100 + (i * 37) % 200),
            max_w=9_000 + 100 * i,
        )
        for i in range(24)
    ]
    racks = rooms(
        room("r0", 30_000),
        room("r1", 25_000),
        room("r2", 50_000, sides=("A",)),
        room("r3", 40_000, site="ams1"),
    )
    return spares, racks, want(14, gpu_models=("H100", "H200"), running={"r0": 1, "r2": 2})


@pytest.mark.parametrize("seed", range(10))
def test_deterministic_whatever_the_input_order(seed: int) -> None:
    spares, racks, w = _fleet()
    expected = choose_spares(spares, racks, w)
    assert expected.short > 0 and expected.chosen  # the fixture exercises both
    rng = random.Random(seed)
    shuffled = spares[:]
    rng.shuffle(shuffled)
    rack_items = list(racks.items())
    rng.shuffle(rack_items)
    assert choose_spares(shuffled, dict(rack_items), w) == expected


# --- shortfall reasons --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("models", "reason"),
    [
        (["L40S"] * 3, "no warm spare with GPU model H100/H200 (3 warm spares are L40S)"),
        (
            ["L40S", "A100", "L40S", "L40S"],
            "no warm spare with GPU model H100/H200 (3 warm spares are L40S, 1 is A100)",
        ),
        (["A100"], "no warm spare with GPU model H100/H200 (1 warm spare is A100)"),
    ],
)
def test_reason_names_the_gpu_models(models: list[str], reason: str) -> None:
    spares = [spare(f"s{i}", gpu_model=m) for i, m in enumerate(models)]
    choice = choose_spares(spares, rooms(room("r1")), want(1, gpu_models=("H100", "H200")))
    assert choice == Choice((), 1, (reason,))


def test_reason_when_some_spares_have_another_model() -> None:
    spares = [spare("h", "r1"), spare("l1", "r2", gpu_model="L40S"), spare("l2", gpu_model="L40S")]
    choice = choose_spares(spares, rooms(room("r1"), room("r2")), want(2, gpu_models=("H100",)))
    assert choice == Choice(("h",), 1, ("2 warm spares are L40S, not H100",))


def test_reason_names_the_spare_with_too_few_gpus() -> None:
    spares = [spare("half", gpu_count=4), spare("one", gpu_count=1), spare("full")]
    choice = choose_spares(spares, rooms(room("r1")), want(3))
    assert choice == Choice(
        ("full",),
        2,
        (
            "spare half has 4 GPUs, fewer than 8 per replica",
            "spare one has 1 GPU, fewer than 8 per replica",
        ),
    )


@pytest.mark.parametrize(
    ("spares", "site", "reasons"),
    [
        ([], None, ("no warm spare, 2 wanted",)),
        ([spare("s1")], None, ("only 1 warm spare, 2 wanted",)),
        (
            [spare("s1", site="ams1")],
            "fra1",
            ("1 warm spare outside site fra1 (ams1: 1)", "no warm spare in site fra1, 2 wanted"),
        ),
    ],
)
def test_reason_when_there_are_too_few_spares(
    spares: list[Spare], site: str | None, reasons: tuple[str, ...]
) -> None:
    racks = rooms(room("r1"))
    choice = choose_spares(spares, racks, want(2, site=site))
    assert choice.reasons == reasons
    assert choice.short == 2 - len(choice.chosen)


def test_every_cause_gets_its_line() -> None:
    spares = [
        spare("l40s", "r1", gpu_model="L40S"),
        spare("small", "r1", gpu_count=4),
        spare("tight", "r2"),
        spare("lost", "r9"),
        spare("ok", "r1"),
    ]
    choice = choose_spares(
        spares, rooms(room("r1"), room("r2", 100)), want(5, gpu_models=("H100",))
    )
    assert choice.chosen == ("ok",)
    assert choice.reasons == (
        "1 warm spare is L40S, not H100",
        "spare small has 4 GPUs, fewer than 8 per replica",
        "rack r9: no power figures (headroom unknown), 1 warm spare not booted",
        "rack r2: 100 W headroom, a spare needs 10,140 W more (10,200 max - 60 standby)",
    )


def test_no_shortfall_no_reasons() -> None:
    spares = [spare("s1"), spare("l40s", gpu_model="L40S"), spare("small", gpu_count=2)]
    choice = choose_spares(spares, rooms(room("r1")), want(1, gpu_models=("H100",)))
    assert choice == Choice(("s1",), 0, ())


def test_nothing_wanted() -> None:
    assert choose_spares([spare("s1")], rooms(room("r1")), want(0)) == Choice((), 0, ())


@pytest.mark.parametrize(
    ("spares", "w", "match"),
    [
        ([spare("s1")], want(-1), "servers"),
        ([spare("s1")], want(gpus_per_replica=0), "gpus_per_replica"),
        ([spare("s1"), spare("s1", "r2")], want(), "duplicate spare names: s1"),
    ],
)
def test_bad_input_is_refused(spares: list[Spare], w: Want, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_spares(spares, rooms(room("r1"), room("r2")), w)


# --- release ------------------------------------------------------------------------------------


def test_release_least_headroom_rack_first() -> None:
    servers = [serving("a", "roomy", 0), serving("b", "tight", 50), serving("c", "mid", 0)]
    racks = rooms(room("roomy", 50_000), room("tight", 100), room("mid", 20_000))
    assert choose_release(servers, racks, "chat", 1) == ("b",)


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, ()),
        (1, ("idle",)),
        (2, ("idle", "busy-1")),  # fewest in flight, then name
        (3, ("idle", "busy-1", "busy-2")),
        (10, ("idle", "busy-1", "busy-2", "busiest")),  # never more than there are
    ],
)
def test_release_fewest_in_flight_then_name(count: int, expected: tuple[str, ...]) -> None:
    servers = [
        serving("busiest", "r1", 90),
        serving("busy-2", "r1", 10),
        serving("idle", "r1", 0),
        serving("busy-1", "r1", 10),
    ]
    assert choose_release(servers, rooms(room("r1", 0)), "chat", count) == expected


def test_release_re_evaluates_headroom_after_each_release() -> None:
    # Releasing one in "tight" frees 10,140 W there (100 -> 10,240), above "mid" (5,000).
    servers = [serving("t1", "tight"), serving("t2", "tight"), serving("m1", "mid", 99)]
    racks = rooms(room("tight", 100), room("mid", 5_000))
    assert choose_release(servers, racks, "chat", 2) == ("t1", "m1")
    assert choose_release(servers, racks, "chat", 3) == ("t1", "m1", "t2")


def test_release_only_the_deployments_servers() -> None:
    servers = [serving("other", "r1", deployment="code"), serving("mine", "r2", 40)]
    racks = rooms(room("r1", 0), room("r2", 90_000))
    assert choose_release(servers, racks, "chat", 2) == ("mine",)
    assert choose_release(servers, racks, "nobody", 2) == ()


def test_release_a_rack_without_power_figures_first() -> None:
    servers = [serving("known", "r1"), serving("unknown", "r9", 100)]
    assert choose_release(servers, rooms(room("r1", -50)), "chat", 1) == ("unknown",)


@pytest.mark.parametrize(
    ("keep", "count", "expected"),
    [
        (0, 5, ("t1", "t2", "t3", "r1")),
        (1, 5, ("t1", "t2")),
        (1, 1, ("t1",)),
        (2, 5, ("t1",)),
        (3, 5, ()),
    ],
)
def test_release_keeps_a_minimum_per_rack(keep: int, count: int, expected: tuple[str, ...]) -> None:
    servers = [
        serving("t1", "tight", 0),
        serving("t2", "tight", 1),
        serving("t3", "tight", 2),
        serving("r1", "roomy", 0),
    ]
    racks = rooms(room("tight", -1e9), room("roomy", 1e6))
    assert choose_release(servers, racks, "chat", count, keep_per_rack_min=keep) == expected


@pytest.mark.parametrize(
    ("count", "keep", "match"),
    [(-1, 0, "count"), (1, -1, "keep_per_rack_min")],
)
def test_release_refuses_bad_input(count: int, keep: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        choose_release([], {}, "chat", count, keep_per_rack_min=keep)


def test_release_refuses_duplicate_names() -> None:
    with pytest.raises(ValueError, match="duplicate serving server names: a"):
        choose_release([serving("a", "r1"), serving("a", "r2")], {}, "chat", 1)


# --- properties ---------------------------------------------------------------------------------

RACKS = ("r1", "r2", "r3", "r4")
SITE_OF = {"r1": "fra1", "r2": "fra1", "r3": "ams1", "r4": "ams1"}

# Round figures often (several spares just fitting a rack together), arbitrary floats too.
watts = st.sampled_from((EXTRA, 5_000.0, 7_500.0)) | st.floats(0, 20_000, allow_nan=False)
headrooms = st.sampled_from((-100.0, 0.0, EXTRA, 15_000.0, 2 * EXTRA, 3 * EXTRA - 1)) | st.floats(
    -5_000, 60_000, allow_nan=False
)


@st.composite
def spares_st(draw: st.DrawFn) -> list[Spare]:
    n = draw(st.integers(0, 12))
    out = []
    for i in range(n):
        rack = draw(st.sampled_from((*RACKS, "r9")))  # r9: no power figures
        standby = draw(st.sampled_from((0.0, 60.0)) | st.floats(0, 500, allow_nan=False))
        out.append(
            Spare(
                name=f"s{i}",
                site=SITE_OF.get(rack, "fra1"),
                rack=rack,
                gpu_model=draw(st.sampled_from(("H100", "H200", "L40S"))),
                gpu_count=draw(st.sampled_from((1, 2, 4, 8))),
                standby_w=standby,
                max_w=standby + draw(watts),
                cached=draw(st.sampled_from(((), (URI,), ("s3://other",)))),
                boot_to_ready_s=draw(st.none() | st.floats(1, 3_600, allow_nan=False)),
            )
        )
    return out


@st.composite
def racks_st(draw: st.DrawFn) -> dict[str, RackRoom]:
    return {
        r: RackRoom(
            r,
            SITE_OF[r],
            draw(headrooms),
            draw(st.sampled_from((("A", "B"), ("A",), ("B",), ()))),
        )
        for r in RACKS
    }


@st.composite
def want_st(draw: st.DrawFn) -> Want:
    return Want(
        deployment="chat",
        model=URI,
        gpu_models=tuple(draw(st.lists(st.sampled_from(("H100", "H200", "L40S")), unique=True))),
        gpus_per_replica=draw(st.sampled_from((1, 2, 4, 8))),
        servers=draw(st.integers(0, 14)),
        running_per_rack=draw(st.dictionaries(st.sampled_from(RACKS), st.integers(0, 5))),
        site=draw(st.sampled_from((None, "fra1", "ams1"))),
    )


def _committed_per_rack(chosen: Sequence[str], spares: Sequence[Spare]) -> dict[str, float]:
    by_name = {s.name: s for s in spares}
    committed: dict[str, float] = {}
    for name in chosen:  # in boot order, as the workflow would add them up
        s = by_name[name]
        committed[s.rack] = committed.get(s.rack, 0.0) + extra_draw_w(s)
    return committed


@settings(max_examples=300, deadline=None)
@given(spares=spares_st(), racks=racks_st(), w=want_st(), seed=st.randoms(use_true_random=False))
def test_property_never_past_a_rack_budget(
    spares: list[Spare], racks: dict[str, RackRoom], w: Want, seed: random.Random
) -> None:
    choice = choose_spares(spares, racks, w)
    assert len(choice.chosen) + choice.short == w.servers
    assert len(set(choice.chosen)) == len(choice.chosen)
    for rack, extra in _committed_per_rack(choice.chosen, spares).items():
        assert extra <= racks[rack].headroom_w
    by_name = {s.name: s for s in spares}
    for name in choice.chosen:
        s = by_name[name]
        assert not w.gpu_models or s.gpu_model in w.gpu_models
        assert s.gpu_count >= w.gpus_per_replica
        assert w.site is None or s.site == w.site
    assert bool(choice.reasons) == (choice.short > 0)
    shuffled = spares[:]
    seed.shuffle(shuffled)
    assert choose_spares(shuffled, racks, w) == choice


@settings(max_examples=200, deadline=None)
@given(
    servers=st.lists(
        st.builds(
            serving,
            name=st.just(""),
            rack=st.sampled_from(RACKS),
            in_flight=st.integers(0, 50),
            deployment=st.sampled_from(("chat", "code")),
        ),
        max_size=12,
    ),
    racks=racks_st(),
    count=st.integers(0, 14),
    keep=st.integers(0, 3),
)
def test_property_release_bounds(
    servers: list[Serving], racks: dict[str, RackRoom], count: int, keep: int
) -> None:
    servers = [
        Serving(f"v{i}", s.rack, s.deployment, s.in_flight, s.max_w, s.standby_w)
        for i, s in enumerate(servers)
    ]
    released = choose_release(servers, racks, "chat", count, keep_per_rack_min=keep)
    mine = [s for s in servers if s.deployment == "chat"]
    assert len(released) <= count
    assert set(released) <= {s.name for s in mine}
    assert len(set(released)) == len(released)
    for rack in RACKS:
        total = sum(s.rack == rack for s in mine)
        gone = sum(s.rack == rack and s.name in released for s in mine)
        assert total - gone >= min(keep, total)


# --- the version cache and boot figures ---------------------------------------------------------

KEY = "llama@v2"


def test_the_deployments_version_key_decides_the_cache_preference() -> None:
    spares = [
        spare("old-version", "r1", cached=("llama@v1",), boot_s=60),
        spare("holds-it", "r2", cached=(KEY,), boot_s=600),
    ]
    w = want(1, model=KEY)
    choice = choose_spares(spares, rooms(room("r1"), room("r2")), w)
    assert choice.chosen == ("holds-it",)
    assert holds(spares[1], w) and not holds(spares[0], w)
    assert not holds(spare("x", cached=("",)), want(1, model=""))  # no version: nothing holds it


def test_the_boot_figure_of_the_cache_state_it_would_boot_in_ranks_spares() -> None:
    # Both hold the version: the one with the faster CACHED boot goes first, whatever their
    # uncached (or older, any-state) figures say.
    a = Spare("a", "fra1", "r1", "H100", 8, 60.0, 10_200.0, (KEY,), 100.0, 500.0, 100.0)
    b = Spare("b", "fra1", "r1", "H100", 8, 60.0, 10_200.0, (KEY,), 900.0, 200.0, 900.0)
    assert spare_boot_s(a, cached=True) == 500.0 and spare_boot_s(a, cached=False) == 100.0
    assert choose_spares([a, b], rooms(room("r1")), want(1, model=KEY)).chosen == ("b",)
    # Never measured in that state: its last boot of any kind stands in.
    c = Spare("c", "fra1", "r1", "H100", 8, 60.0, 10_200.0, (), 300.0)
    assert spare_boot_s(c, cached=True) == 300.0


def test_expected_boot_is_the_p90_of_the_model_and_cache_state() -> None:
    figures = BootFigures(
        {("H100", True): (95.0, 4), ("H100", False): (780.0, 3), ("L40S", None): (600.0, 1)}
    )
    assert expected_boot_s("H100", True, figures, 900.0) == (
        95.0,
        "H100, version cached: p90 of 4 cached boots",
    )
    assert expected_boot_s("H100", False, figures, 900.0)[0] == 780.0
    # Only boots of unknown state: they stand in for either state.
    assert expected_boot_s("L40S", True, figures, 900.0) == (
        600.0,
        "L40S, version cached: p90 of 1 boot",
    )
    # A cached spare may count on the slower uncached figure; an uncached one never on the
    # faster cached one.
    only_uncached = BootFigures({("H100", False): (780.0, 3)})
    only_cached = BootFigures({("H100", True): (95.0, 4)})
    assert expected_boot_s("H100", True, only_uncached, 900.0)[0] == 780.0
    assert expected_boot_s("H100", False, only_cached, 900.0) == (
        900.0,
        "H100, version not cached: never measured, default",
    )


def test_why_names_the_cache_state_rack_and_boot() -> None:
    w = want(1, model=KEY)
    cached = spare("gpu3", "r2", cached=(KEY,))
    assert why(cached, w, boot=(95.0, "H100, version cached: p90 of 4 cached boots")) == (
        "gpu3: version llama@v2 cached; H100 in rack r2; boot 95 s "
        "(H100, version cached: p90 of 4 cached boots)"
    )
    assert why(spare("gpu4"), w, named=False) == (
        "version llama@v2 not cached: fetches first; H100 in rack r1"
    )
