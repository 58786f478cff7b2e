"""Limiter: cluster-wide budgets decided locally from leases, against a real server: clients of
uneven demand stay within the budget and share it; a key is held to this client's share of its
limit; reported failures open the rule's breaker; bad options name the option."""

from __future__ import annotations

import time

import grpc
import pytest

import levee
from levee.limiter import BREAKER_OPEN, Limiter, LimiterOptions
from levee.v1 import limits_pb2, limits_pb2_grpc


def set_rule(server, rule: "limits_pb2.LimitRule") -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(server.grpc_addr) as channel:
        limits_pb2_grpc.LimitsStub(channel).SetRule(limits_pb2.SetLimitRuleRequest(rule=rule))


def offer(limiter: Limiter, resource: str, per_ms: int, seconds: float, key: bytes = b"") -> int:
    admitted = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for _ in range(per_ms):
            if key:
                admitted += limiter.try_acquire_key(resource, key)
            else:
                admitted += limiter.try_acquire(resource)
        time.sleep(0.001)
    return admitted


def wait_for_lease(limiter: Limiter, resource: str) -> None:
    deadline = time.monotonic() + 5
    while not limiter.try_acquire(resource):
        assert time.monotonic() < deadline, "no lease within 5 s"
        time.sleep(0.01)


def test_given_bad_options_then_errors_name_the_option() -> None:
    with pytest.raises(levee.InvalidArgumentError, match="servers"):
        Limiter.start(LimiterOptions(servers=[]))
    with pytest.raises(levee.InvalidArgumentError, match="lease_interval_s"):
        Limiter.start(LimiterOptions(servers=["127.0.0.1:1"], lease_interval_s=0))


def test_given_two_limiters_of_uneven_demand_then_they_share_the_budget_and_never_pass_it(
    server, unique  # type: ignore[no-untyped-def]
) -> None:
    resource = unique("pay")
    set_rule(server, limits_pb2.LimitRule(resource=resource, permits=1000, period_ms=1000))
    with Limiter.start(LimiterOptions([server.grpc_addr])) as greedy, \
            Limiter.start(LimiterOptions([server.grpc_addr])) as modest:
        started = time.monotonic()
        greedy_admitted = offer(greedy, resource, 5, 2.0)
        modest_admitted = offer(modest, resource, 1, 2.0)
        elapsed_ms = (time.monotonic() - started) * 1000
        # One after the other: 1,000 a second over the whole time, and a period at each end.
        assert greedy_admitted + modest_admitted <= elapsed_ms + 200
        assert greedy_admitted >= 800, greedy_admitted
        # Under the budget, the modest client gets most of what it asks for (the first lease
        # period of a resource has no lease yet).
        stats = modest.stats()
        assert stats.admitted >= 0.6 * (stats.admitted + stats.refused), stats
        assert greedy.stats().connected and greedy.stats().leases_received >= 10
    with Limiter.start(LimiterOptions([server.grpc_addr])) as unruled:
        assert offer(unruled, unique("no-rule"), 1, 0.3) == 0
        assert unruled.stats().fallback_decisions > 0


def test_given_a_per_key_limit_then_two_limiters_hold_a_key_to_it(server, unique) -> None:  # type: ignore[no-untyped-def]
    resource = unique("search")
    rule = limits_pb2.LimitRule(
        resource=resource, permits=1_000_000, period_ms=1000,
        per_key=limits_pb2.PerKeyLimit(exceptions=[limits_pb2.KeyLimit(key=b"vip", permits=100)]),
    )
    set_rule(server, rule)
    with Limiter.start(LimiterOptions([server.grpc_addr])) as first, \
            Limiter.start(LimiterOptions([server.grpc_addr])) as second:
        wait_for_lease(first, resource)
        wait_for_lease(second, resource)
        time.sleep(0.3)  # both counted among the clients sharing the limits
        started = time.monotonic()
        vip = 0
        while time.monotonic() - started < 1.0:
            vip += first.try_acquire_key(resource, b"vip") + second.try_acquire_key(resource, b"vip")
            time.sleep(0.001)
        elapsed_s = time.monotonic() - started
        # 100 a second over both (50 each, a burst of 5 each), a doubled share for a period.
        assert vip <= 100 * elapsed_s + 10 + 10, vip
        assert vip >= 50, vip
        assert first.stats().key_refused > 0
        # A key without a limit of its own is never refused by a key limit (only, while the
        # lease grows to its demand, by the lease).
        refused = first.stats().key_refused
        assert offer(first, resource, 2, 0.3, key=b"cold") > 0
        assert first.stats().key_refused == refused


def test_given_failing_calls_then_the_rules_breaker_opens(server, unique) -> None:  # type: ignore[no-untyped-def]
    resource = unique("db")
    rule = limits_pb2.LimitRule(
        resource=resource, permits=10_000, period_ms=1000,
        breaker=limits_pb2.BreakerSpec(error_count=5, min_calls=5, window_ms=2000, open_ms=5000),
    )
    set_rule(server, rule)
    with Limiter.start(LimiterOptions([server.grpc_addr])) as limiter:
        wait_for_lease(limiter, resource)
        failed = 0
        deadline = time.monotonic() + 5
        # Five failures trip it (more may find the leases empty once it opens).
        while failed < 5 and time.monotonic() < deadline:
            try:
                with limiter.call(resource) as admitted:
                    if admitted:
                        raise RuntimeError("the database is down")
            except RuntimeError:
                failed += 1
            time.sleep(0.005)
        assert failed == 5
        deadline = time.monotonic() + 2
        while limiter.breaker(resource) != BREAKER_OPEN:
            assert time.monotonic() < deadline, "the breaker did not open"
            time.sleep(0.01)


def test_given_a_share_then_the_burst_passes_exactly_and_recovers_exactly() -> None:
    """GCRA in whole nanoseconds: 400 a second among 4 clients is 100 a second here, a burst of
    10; at any clock value the burst passes whole and a recovered key answers as a fresh one."""
    from levee.limiter import _KeyShares

    limits = limits_pb2.KeyLimits(version=1, period_ms=1000, clients=4,
                                  keys=[limits_pb2.KeyLimit(key=b"k", permits=400)])
    for now in (0, 123_456_789_012_345, 987_654_321_987_654_321):
        shares = _KeyShares(limits)
        assert sum(shares.try_acquire(b"k", 1, now) for _ in range(20)) == 10
        # 10 ms a permit: a second later it has fully recovered.
        assert sum(shares.try_acquire(b"k", 1, now + 1_000_000_000) for _ in range(20)) == 10
    slow = limits_pb2.KeyLimits(version=1, period_ms=1000, clients=1,
                                keys=[limits_pb2.KeyLimit(key=b"k", permits=3)])
    shares = _KeyShares(slow)
    admitted = sum(shares.try_acquire(b"k", 1, 10**17 + step * 334_000_000) for step in range(30))
    assert admitted == 30, "one every 334 ms under 3 a second: every one passes"


def test_given_negative_permits_then_nothing_is_taken_or_added() -> None:
    limiter = Limiter(LimiterOptions(servers=["127.0.0.1:1"], fallback_permits=5))
    assert not limiter.try_acquire("r", -5)
    assert not limiter.try_acquire_key("r", b"k", -5)
    assert sum(limiter.try_acquire("r") for _ in range(10)) == 5, "the fallback is intact"
