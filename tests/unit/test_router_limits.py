"""The router's per-key rate limits and tenant shares (fleet/router/limits.py) with a fake clock,
and the callers document (fleet/router/callers.py)."""

from __future__ import annotations

import pytest

from fleet.router.callers import CallersError, key_hash, parse_callers
from fleet.router.limits import BUCKETS, KeyLimits, RateLimiter, over_share, share_slots

WINDOW = 6.0  # seconds: a limit of 60/min allows 6 per window


def admit_all(limiter: RateLimiter, key: KeyLimits, at: float, tokens: float = 0) -> int:
    """Requests admitted at `at` until the first refusal (bounded)."""
    for n in range(10_000):
        if limiter.check(key, at) is not None:
            return n
        limiter.admit(key, at, tokens)
    raise AssertionError("never refused")


def test_requests_per_minute_scale_to_the_window_and_free_as_it_slides() -> None:
    limiter = RateLimiter(WINDOW)
    key = KeyLimits("1", requests_per_minute=60)
    assert admit_all(limiter, key, 100.0) == 6
    refusal = limiter.check(key, 100.0)
    assert refusal is not None
    assert "60 requests per minute" in refusal.message
    # All six leave once their bucket is a whole window behind: 6 s + one bucket (0.1 s)
    assert refusal.retry_after_s == 7
    assert limiter.check(key, 100.0 + WINDOW - 0.5) is not None
    assert limiter.check(key, 100.0 + WINDOW + WINDOW / BUCKETS + 0.01) is None


def test_spread_requests_free_one_at_a_time_and_retry_after_says_when() -> None:
    limiter = RateLimiter(WINDOW)
    key = KeyLimits("1", requests_per_minute=60)
    for i in range(6):  # one a second
        assert limiter.check(key, float(i)) is None
        limiter.admit(key, float(i), 0)
    refusal = limiter.check(key, 5.5)
    assert refusal is not None
    # The first (t=0, bucket [0, 0.1)) leaves at 6.1: 0.6 s from now, rounded up to 1
    assert refusal.retry_after_s == 1
    assert limiter.check(key, 6.15) is None
    limiter.admit(key, 6.15, 0)
    assert limiter.check(key, 6.2) is not None  # full again until t=1 leaves


def test_a_limit_below_one_request_per_window_still_allows_one() -> None:
    limiter = RateLimiter(1.0)
    key = KeyLimits("1", requests_per_minute=6)  # 0.1 per window
    assert admit_all(limiter, key, 0.0) == 1


def test_unlimited_keys_are_never_refused_nor_tracked() -> None:
    limiter = RateLimiter(WINDOW)
    key = KeyLimits("1")
    for _ in range(1000):
        assert limiter.check(key, 0.0) is None
        limiter.admit(key, 0.0, 10)
    assert limiter.usage(0.0) == {}


def test_tokens_per_minute_admit_while_under_and_settle_to_the_actual() -> None:
    limiter = RateLimiter(WINDOW)
    key = KeyLimits("7", tokens_per_minute=1000)  # 100 per window
    limiter.admit(key, 0.0, 80)
    assert limiter.check(key, 0.0) is None  # 80 < 100: one more may go, whatever its size
    limiter.admit(key, 0.0, 80)
    refusal = limiter.check(key, 0.0)
    assert refusal is not None and "1000 tokens per minute" in refusal.message
    # One request used only 10 of its 80: the key is under its allowance again
    limiter.settle(key, 0.5, -70)
    assert limiter.check(key, 0.5) is None
    assert limiter.usage(0.5) == {"7": (2.0, 90.0)}
    # Settling never takes the window below zero
    limiter.settle(key, 0.6, -1e6)
    assert limiter.usage(0.6)["7"][1] == 0.0


def test_other_routers_usage_counts_until_a_window_old() -> None:
    limiter = RateLimiter(WINDOW)
    key = KeyLimits("3", requests_per_minute=60)  # 6 per window
    limiter.set_others({"3": (4.0, 0.0)}, now=10.0, peers=1)
    # 2 of 6 are left; until the fleet answers again this router takes its half of them (the
    # other router may take the other)
    assert admit_all(limiter, key, 10.0) == 1
    refusal = limiter.check(key, 10.0)
    assert refusal is not None
    # Own buckets leave at 16.1; the others' 4 free evenly (4 / 6 s): one in 1.5 s
    assert refusal.retry_after_s == 2
    # The next answer: the other router took nothing more; the last spare one is the busier
    # router's, not this one's (else both would take it)
    limiter.set_others({"3": (4.0, 0.0)}, now=10.2, peers=1)
    assert admit_all(limiter, key, 10.2) == 0
    limiter.set_others({"3": (1.0, 0.0)}, now=10.3, peers=1)  # now this router is the busier
    assert admit_all(limiter, key, 10.3) == 2  # half the 4 spare
    assert limiter.usage(10.3) == {"3": (3.0, 0.0)}
    # The fleet stopped answering: after a whole window the others' figures no longer count
    assert limiter.others_from("3", 10.3 + WINDOW + 0.01) == (0.0, 0.0)


def test_routers_hammering_one_key_keep_its_limit_window_after_window() -> None:
    """Two routers exchanging usage through a fleet every 0.1 s, both hammered for 20 windows:
    every window of the key admits at most its allowance, and the total is what one limiter
    would admit. (Each taking all the headroom it knew of, both took the window's allowance
    whenever it freed on both at once: twice the limit, window after window.)"""
    routers = [RateLimiter(WINDOW), RateLimiter(WINDOW)]
    key = KeyLimits("7", requests_per_minute=60)  # 6 per window
    reported: list[dict[str, tuple[float, float]]] = [{}, {}]
    admitted: list[float] = []
    step, answer_every = 0.01, 10  # hammer every 10 ms; the fleet answers every 0.1 s
    for tick in range(int(20 * WINDOW / step)):
        now = tick * step
        for n, limiter in enumerate(routers):
            if tick % answer_every == 0:  # report, then take the other's latest figures
                reported[n] = limiter.usage(now)
                limiter.set_others(reported[1 - n], now, peers=1)
            while limiter.check(key, now) is None:
                limiter.admit(key, now, 0)
                admitted.append(now)
    worst = max(sum(1 for t in admitted if start <= t < start + WINDOW) for start in admitted)
    assert worst <= 6 + 1  # one over: both take a last spare request on a tie of use
    assert len(admitted) <= 1.05 * 6 * (20 + 1)  # one limiter's, within the ties' few


def test_idle_and_forgotten_keys_leave_the_books() -> None:
    limiter = RateLimiter(WINDOW)
    a, b = KeyLimits("a", requests_per_minute=60), KeyLimits("b", requests_per_minute=60)
    limiter.admit(a, 0.0, 0)
    limiter.admit(b, 0.0, 0)
    limiter.forget({"a"})
    assert set(limiter.usage(1.0)) == {"a"}
    assert limiter.usage(100.0) == {}
    assert limiter.windows == {}


def test_buckets_bound_a_keys_memory() -> None:
    limiter = RateLimiter(WINDOW)
    key = KeyLimits("1", requests_per_minute=10_000_000)
    for i in range(20_000):
        limiter.admit(key, i * 0.001, 1)
    assert len(limiter.windows["1"].buckets) <= BUCKETS + 2


def test_tenant_share_caps_only_a_contended_deployment() -> None:
    assert share_slots(0.5, 10) == 5
    assert share_slots(0.01, 10) == 1  # at least one
    assert share_slots(0.25, 10) == 3  # rounded up
    assert not over_share(4, 0.5, 10, contended=True)
    assert over_share(5, 0.5, 10, contended=True)
    assert not over_share(50, 0.5, 10, contended=False)  # free slots: anyone may use them
    assert not over_share(50, 1.0, 10, contended=True)  # a whole share never caps


def test_callers_document_by_hash_or_plaintext_key() -> None:
    secret = "fk_" + "x" * 43
    callers = parse_callers(
        {
            "tenants": [{"name": "acme", "concurrency_share": 0.5}],
            "keys": [
                {"id": 12, "hash": key_hash(secret), "tenant": "acme", "name": "ci-bot"},
                {"key": "fk_other", "tenant": "beta", "name": "b", "requests_per_minute": 5},
            ],
        }
    )
    caller = callers.authenticate(f"Bearer {secret}")
    assert caller is not None and caller.tenant == "acme" and caller.key_id == "12"
    assert not caller.limits.limited
    other = callers.authenticate("Bearer fk_other")
    assert other is not None and other.key_id == "b"  # the id defaults to the name
    assert other.limits.requests_per_minute == 5
    assert callers.authenticate(None) is None
    assert callers.authenticate("Bearer ") is None
    assert callers.authenticate("Basic abc") is None
    assert callers.authenticate("Bearer fk_unknown") is None
    assert callers.share("acme") == 0.5 and callers.share("beta") == 1.0
    assert callers.ids() == {"12", "b"}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "must be an object"),
        ({"keys": [{"name": "k", "tenant": "t"}]}, "needs a hash"),
        ({"keys": [{"name": "k", "tenant": "t", "hash": "abc"}]}, "needs a hash"),
        ({"keys": [{"name": "k", "key": "fk_1"}]}, "needs a name and a tenant"),
        (
            {"keys": [{"name": "k", "tenant": "t", "key": "fk_1", "requests_per_minute": 0}]},
            "requests_per_minute must be a positive integer",
        ),
        ({"tenants": [{"name": "t", "concurrency_share": 1.5}]}, "concurrency_share"),
    ],
)
def test_malformed_callers_documents_say_where(doc: object, message: str) -> None:
    with pytest.raises(CallersError, match=message):
        parse_callers(doc)
