//! Property tests of the engine's counting against an exact model: random streams of weighted
//! reports and ticks over a few keys and two rules, checked for the two documented bounds.
//!
//! - No false negatives: whenever the exact count of a key in `(now - window_ms, now]` reaches
//!   its threshold, the key is hot right after the report.
//! - No false positives beyond the bound: whenever the engine reports `Hot(Detected)`, the exact
//!   count in `(now - window_ms - slot_ms, now]` is at least `threshold - admission + 1`.

use levee_hotkey::{EngineConfig, Event, HotKeyEngine, HotSource, Rule, RuleMatch};
use proptest::prelude::*;

const APP: &str = "model";
const KEYS: [&str; 5] = ["a1", "a2", "b1", "b2", "c"];
const ADMISSION_DIVISOR: u64 = 8;
/// Longer than every window plus its slot.
const HISTORY_MS: u64 = 2_000;

#[derive(Debug, Clone)]
enum Operation {
    Report {
        key: usize,
        count: u32,
        advance_ms: u64,
    },
    Tick {
        advance_ms: u64,
    },
    Batch {
        items: Vec<(usize, u32)>,
        advance_ms: u64,
    },
}

#[derive(Debug, Clone)]
struct Scenario {
    prefix_rule: Rule,
    /// `None`: the app has no `*` rule, so keys not starting with "a" are not counted.
    default_rule: Option<Rule>,
    sketch_bytes: usize,
    /// `Some`: a budget so small that it binds (degraded mode: only the precision bound holds
    /// once a key was evicted or refused).
    budget_bytes: Option<usize>,
    operations: Vec<Operation>,
}

fn rule_strategy(matcher: RuleMatch) -> impl Strategy<Value = Rule> {
    (
        prop_oneof![Just(100_u32), Just(250), Just(1_000)],
        // Admission 1 (exact from the first hit), a few, and many hits in the sketch first.
        prop_oneof![1_u64..=8, 9_u64..=40, 41_u64..=160],
        1_u64..=1_500,
    )
        .prop_map(move |(window_ms, threshold, hot_duration_ms)| Rule {
            matcher: matcher.clone(),
            window_ms,
            threshold,
            hot_duration_ms,
            description: String::new(),
        })
}

fn operation_strategy() -> impl Strategy<Value = Operation> {
    prop_oneof![
        8 => (
            0..KEYS.len(),
            prop_oneof![Just(1_u32), 1_u32..=4, 1_u32..=40],
            prop_oneof![Just(0_u64), 0_u64..=10, 0_u64..=40, 0_u64..=400],
        )
            .prop_map(|(key, count, advance_ms)| Operation::Report { key, count, advance_ms }),
        1 => (0_u64..=300).prop_map(|advance_ms| Operation::Tick { advance_ms }),
        2 => (
            prop::collection::vec((0..KEYS.len(), prop_oneof![Just(1_u32), 1_u32..=10]), 1..40),
            0_u64..=100,
        )
            .prop_map(|(items, advance_ms)| Operation::Batch { items, advance_ms }),
    ]
}

fn scenario_strategy() -> impl Strategy<Value = Scenario> {
    (
        rule_strategy(RuleMatch::Prefix(b"a".to_vec())),
        prop::option::weighted(0.8, rule_strategy(RuleMatch::Default)),
        // One block (every key collides: inflated estimates) or a roomy sketch.
        prop_oneof![Just(64_usize), Just(64 * 1024)],
        prop::option::weighted(0.3, 2_500_usize..4_000),
        prop::collection::vec(operation_strategy(), 1..300),
    )
        .prop_map(
            |(prefix_rule, default_rule, sketch_bytes, budget_bytes, operations)| Scenario {
                prefix_rule,
                default_rule,
                sketch_bytes,
                budget_bytes,
                operations,
            },
        )
}

fn rule_of<'a>(scenario: &'a Scenario, key: &str) -> Option<&'a Rule> {
    if key.starts_with('a') {
        Some(&scenario.prefix_rule)
    } else {
        scenario.default_rule.as_ref()
    }
}

fn slot_ms(window_ms: u64) -> u64 {
    (window_ms / 10).max(10)
}

/// Exact hits of `key` at times in `(now - span, now]`.
fn exact_count(history: &[(u64, usize, u64)], key: usize, now_ms: u64, span_ms: u64) -> u64 {
    history
        .iter()
        .filter(|&&(time, other, _)| other == key && time + span_ms > now_ms)
        .map(|&(_, _, count)| count)
        .sum()
}

/// Checks both bounds after `reported` keys were reported at `now_ms` and produced `events`.
fn check(
    scenario: &Scenario,
    engine: &HotKeyEngine,
    history: &[(u64, usize, u64)],
    events: &[Event],
    reported: &[usize],
    now_ms: u64,
) -> Result<(), TestCaseError> {
    for &key in reported {
        let Some(rule) = rule_of(scenario, KEYS[key]) else {
            continue;
        };
        let window_ms = u64::from(rule.window_ms);
        let exact = exact_count(history, key, now_ms, window_ms);
        // The no-false-negative bound holds while the budget has evicted or refused nothing.
        if exact >= rule.threshold && engine.memory().budget_evictions == 0 {
            prop_assert!(
                engine.is_hot(APP, KEYS[key].as_bytes(), now_ms),
                "false negative: {} has {exact} hits in the last {window_ms} ms at {now_ms}, threshold {}",
                KEYS[key],
                rule.threshold
            );
        }
    }
    for event in events {
        let Event::Hot(hot) = event else { continue };
        let key = KEYS
            .iter()
            .position(|key| key.as_bytes() == hot.key)
            .expect("a known key");
        prop_assert!(
            reported.contains(&key),
            "hot event for a key not reported now"
        );
        prop_assert_eq!(hot.source, HotSource::Detected);
        let Some(rule) = rule_of(scenario, KEYS[key]) else {
            return Err(TestCaseError::fail(format!(
                "{} matches no rule",
                KEYS[key]
            )));
        };
        let window_ms = u64::from(rule.window_ms);
        let admission = (rule.threshold / ADMISSION_DIVISOR).max(1);
        let loose = exact_count(history, key, now_ms, window_ms + slot_ms(window_ms));
        prop_assert!(
            loose + admission > rule.threshold,
            "false positive: {} hot with {loose} hits in window + slot at {now_ms}, threshold {} admission {admission}",
            KEYS[key],
            rule.threshold
        );
        prop_assert!(hot.count >= rule.threshold);
    }
    let memory = engine.memory();
    let stats = engine.stats(APP).expect("the app exists");
    prop_assert!(
        memory.used_bytes <= memory.budget_bytes || stats.keys_tracked == stats.hot_now,
        "over budget with cold keys to evict: {memory:?} {stats:?}"
    );
    Ok(())
}

fn run(scenario: &Scenario) -> Result<(), TestCaseError> {
    let mut engine = HotKeyEngine::new(EngineConfig {
        sketch_bytes: scenario.sketch_bytes,
        admission_divisor: ADMISSION_DIVISOR,
        memory_budget_bytes: scenario
            .budget_bytes
            .unwrap_or(EngineConfig::default().memory_budget_bytes),
        ..EngineConfig::default()
    });
    let mut rules = vec![scenario.prefix_rule.clone()];
    rules.extend(scenario.default_rule.clone());
    engine.set_rules(APP, rules).expect("valid rules");
    let mut history: Vec<(u64, usize, u64)> = Vec::new();
    let mut now_ms = 10_000;
    let mut events = Vec::new();
    for operation in &scenario.operations {
        events.clear();
        // Hits older than the longest window plus its slot no longer matter.
        history.retain(|&(time, _, _)| time + HISTORY_MS > now_ms);
        match operation {
            Operation::Tick { advance_ms } => {
                now_ms += advance_ms;
                engine.tick(now_ms, &mut events);
            }
            Operation::Report {
                key,
                count,
                advance_ms,
            } => {
                now_ms += advance_ms;
                engine
                    .report(APP, KEYS[*key].as_bytes(), *count, now_ms, &mut events)
                    .expect("valid report");
                history.push((now_ms, *key, u64::from(*count)));
                check(scenario, &engine, &history, &events, &[*key], now_ms)?;
            }
            Operation::Batch { items, advance_ms } => {
                now_ms += advance_ms;
                let batch: Vec<(&[u8], u32)> = items
                    .iter()
                    .map(|&(key, count)| (KEYS[key].as_bytes(), count))
                    .collect();
                let outcome = engine
                    .report_batch(APP, &batch, now_ms, &mut events)
                    .expect("valid batch");
                prop_assert_eq!(outcome.accepted, items.len());
                history.extend(
                    items
                        .iter()
                        .map(|&(key, count)| (now_ms, key, u64::from(count))),
                );
                let mut keys: Vec<usize> = items.iter().map(|&(key, _)| key).collect();
                keys.sort_unstable();
                keys.dedup();
                check(scenario, &engine, &history, &events, &keys, now_ms)?;
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn given_random_streams_when_counted_should_have_no_false_negatives_and_bounded_false_positives(
        scenario in scenario_strategy()
    ) {
        run(&scenario)?;
    }
}
