//! Property tests of the limits' promises, in virtual time: a rate limiter never admits more
//! than its burst plus its rate over any interval (warm-up and queueing included), and a lease
//! allocator never grants more than a window's budget, nor more than a client asked for.

use levee_limit::{Decision, LeaseAllocator, LeaseRule, RateLimiter, RateRule, Warmup};
use proptest::prelude::*;

const MS: u64 = 1_000_000;

fn rate_rule() -> impl Strategy<Value = RateRule> {
    (
        1_u64..5_000,
        prop_oneof![
            Just(MS),
            Just(100 * MS),
            Just(1_000 * MS),
            Just(60_000 * MS)
        ],
        any::<u64>(),
        prop::option::of((2_u32..=10, 1_u64..2_000)),
        prop_oneof![Just(0_u64), 1_u64..500],
    )
        .prop_map(|(permits, period_ns, burst, warmup, wait_ms)| RateRule {
            permits,
            period_ns,
            burst: 1 + burst % permits,
            warmup: warmup.map(|(cold_factor, period_ms)| Warmup {
                period_ns: period_ms * MS,
                cold_factor,
            }),
            max_wait_ns: wait_ms * MS,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Over any interval [a, b] of the times calls may go (now, or now plus their wait), the
    /// permits admitted are at most burst + (b - a) x rate, to the nanosecond (waits are whole
    /// nanoseconds, rounded up).
    #[test]
    fn given_any_calls_then_a_rate_limiter_never_admits_beyond_burst_plus_rate(
        rule in rate_rule(),
        calls in prop::collection::vec((0_u64..20 * MS, 1_u64..8), 1..200),
    ) {
        let mut limiter = RateLimiter::new(rule).unwrap();
        let mut now = 0_u64;
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for (step, permits) in calls {
            now += step;
            match limiter.try_acquire(permits, now) {
                Decision::Admitted => admitted.push((now, permits)),
                Decision::Wait(wait) => {
                    prop_assert!(wait <= rule.max_wait_ns);
                    admitted.push((now + wait, permits));
                }
                Decision::Rejected { .. } => {}
                Decision::TooLarge => prop_assert!(permits > rule.burst),
            }
        }
        admitted.sort_unstable();
        for first in 0..admitted.len() {
            let mut total = 0_u128;
            for last in first..admitted.len() {
                total += u128::from(admitted[last].1);
                // Waits are whole nanoseconds, rounded up: a waited call's time is up to 1 ns
                // later than the exact one, so a span may be up to 1 ns shorter than exact.
                let span = u128::from(admitted[last].0 - admitted[first].0) + 1;
                let bound = u128::from(rule.burst) * u128::from(rule.period_ns)
                    + span * u128::from(rule.permits);
                prop_assert!(
                    total * u128::from(rule.period_ns) <= bound,
                    "{} permits in {} ns under {:?}", total, span, rule
                );
            }
        }
    }

    /// Grants never exceed a window's budget in sum, nor a client's demand; with clients
    /// giving back tokens (at most what they hold) and being topped up, and the rule changing
    /// at any time, what the clients can spend in a window never passes the budget the rule
    /// gave it when it was first asked for.
    #[test]
    fn given_any_requests_then_leases_stay_within_each_windows_budget(
        permits_per_s in 1_u64..100_000,
        requests in prop::collection::vec(
            (
                0_u64..30 * MS,
                0_u64..20,
                0_u64..50_000,
                0_u64..2_000,
                prop::option::weighted(0.1, 1_u64..100_000),
            ),
            1..300,
        ),
    ) {
        let mut leases = LeaseAllocator::new(LeaseRule::per_second(permits_per_s)).unwrap();
        let mut now = 0_u64;
        // What each (client, window) may spend: grants and top-ups, less what it gave back.
        let mut holding = std::collections::BTreeMap::<(u64, u64), u64>::new();
        // Each window's budget when first asked for.
        let mut budgets = std::collections::BTreeMap::<u64, u64>::new();
        for (step, client, demand, returned, new_rule) in requests {
            if let Some(permits) = new_rule {
                leases.set_rule(LeaseRule::per_second(permits)).unwrap();
            }
            now += step;
            let current = now / (100 * MS);
            let asked = if 100 * MS - now % (100 * MS) <= 20 * MS { current + 1 } else { current };
            budgets.entry(asked).or_insert_with(|| leases.rule_budget(asked));
            let held = holding.entry((client, current)).or_default();
            let given_back = returned.min(*held);
            let grant = leases.request_returning(client, demand, returned, now);
            prop_assert!(grant.permits <= demand);
            prop_assert!(grant.starts_at >= now && grant.starts_at < grant.expires_at);
            let window = grant.expires_at / (100 * MS) - 1;
            if window == current + 1 {
                let held = holding.entry((client, current)).or_default();
                *held = *held - given_back + grant.top_up;
            } else {
                prop_assert_eq!(grant.top_up, 0);
            }
            *holding.entry((client, window)).or_default() += grant.permits;
        }
        let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
        for ((_, window), held) in holding {
            *per_window.entry(window).or_default() += held;
        }
        for (window, held) in per_window {
            prop_assert!(held <= budgets[&window], "window {window}: {held}");
        }
    }
}
