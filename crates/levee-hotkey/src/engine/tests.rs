//! Engine unit tests, all on virtual time.

use super::*;
use crate::app::{ENTRY_SLOT_BYTES, Entry};
use crate::rule::{Rule, RuleError, RuleMatch};

const APP: &str = "shop";

/// The tests' engine: a fixed hash seed, so every run sees the same sketch collisions. With a
/// random one, two keys of a test share their sketch cells about once in a thousand runs and
/// the later one is admitted with the earlier one's hits as credit (capped at its admission:
/// the bounded overcount the crate documents), which tests of exact counts are not about (CI
/// once saw "c" at 324 instead of 200 in the top-k test). Tests of collisions set their own.
fn config() -> EngineConfig {
    EngineConfig {
        sketch_bytes: 64 * 1024,
        memory_budget_bytes: 64 * 1024 * 1024,
        hash_seed: Some(20_261_123),
        ..EngineConfig::default()
    }
}

fn rule(matcher: RuleMatch, window_ms: u32, threshold: u64, hot_duration_ms: u64) -> Rule {
    Rule {
        matcher,
        window_ms,
        threshold,
        hot_duration_ms,
        description: String::new(),
    }
}

fn prefix(prefix: &str) -> RuleMatch {
    RuleMatch::Prefix(prefix.as_bytes().to_vec())
}

fn exact(key: &str) -> RuleMatch {
    RuleMatch::Exact(key.as_bytes().to_vec())
}

fn engine_with(rules: Vec<Rule>) -> HotKeyEngine {
    let mut engine = HotKeyEngine::new(config());
    engine.set_rules(APP, rules).unwrap();
    engine
}

fn report(engine: &mut HotKeyEngine, key: &str, count: u32, now_ms: u64) -> Vec<Event> {
    let mut events = Vec::new();
    engine
        .report(APP, key.as_bytes(), count, now_ms, &mut events)
        .unwrap();
    events
}

fn hot_events(events: &[Event]) -> Vec<&HotEvent> {
    events
        .iter()
        .filter_map(|event| match event {
            Event::Hot(hot) => Some(hot),
            Event::Cool { .. } => None,
        })
        .collect()
}

fn count_of(engine: &HotKeyEngine, key: &str, now_ms: u64) -> u64 {
    engine
        .top_k(APP, usize::MAX, now_ms)
        .into_iter()
        .find(|item| item.key == key.as_bytes())
        .map_or(0, |item| item.count)
}

#[test]
fn given_hit_at_t_when_window_passes_should_count_until_window_minus_one_and_drop_by_window_plus_slot()
 {
    // threshold 8 / divisor 8: admission 1, exact from the first hit.
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 8, 60_000)]);
    let t = 10_050;
    report(&mut engine, "k", 1, t);
    assert_eq!(count_of(&engine, "k", t + 999), 1);
    assert_eq!(count_of(&engine, "k", t + 1_000 + 100), 0);
}

#[test]
fn given_hits_one_window_apart_when_threshold_two_should_turn_hot_only_inside_the_window() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 2, 60_000)]);
    report(&mut engine, "inside", 1, 5_000);
    let events = report(&mut engine, "inside", 1, 5_999);
    assert_eq!(
        hot_events(&events).len(),
        1,
        "second hit within 1000 ms is hot"
    );
    report(&mut engine, "outside", 1, 10_000);
    let events = report(&mut engine, "outside", 1, 10_000 + 1_000 + 100);
    assert!(
        events.is_empty(),
        "a hit window + slot later is not counted with the first"
    );
}

#[test]
fn given_exact_prefix_and_default_rules_when_reported_should_apply_exact_then_longest_prefix() {
    let mut engine = engine_with(vec![
        rule(prefix("pin_"), 1_000, 3, 60_000),
        rule(RuleMatch::Default, 1_000, 4, 60_000),
        rule(prefix("pin_vip_"), 1_000, 2, 60_000),
        rule(exact("pin_vip_ceo"), 1_000, 1, 60_000),
    ]);
    let hits_to_hot = |engine: &mut HotKeyEngine, key: &str| -> (u32, RuleMatch) {
        for hit in 1..=10 {
            let events = report(engine, key, 1, 1_000);
            if let Some(hot) = hot_events(&events).first() {
                return (hit, hot.rule.clone());
            }
        }
        panic!("{key} never turned hot");
    };
    assert_eq!(
        hits_to_hot(&mut engine, "pin_vip_ceo"),
        (1, exact("pin_vip_ceo"))
    );
    assert_eq!(
        hits_to_hot(&mut engine, "pin_vip_42"),
        (2, prefix("pin_vip_"))
    );
    assert_eq!(hits_to_hot(&mut engine, "pin_42"), (3, prefix("pin_")));
    assert_eq!(
        hits_to_hot(&mut engine, "order_42"),
        (4, RuleMatch::Default)
    );
}

#[test]
fn given_no_default_rule_when_key_matches_nothing_should_not_count_it() {
    let mut engine = engine_with(vec![rule(prefix("pin_"), 1_000, 1, 60_000)]);
    for now_ms in 0..100 {
        assert!(report(&mut engine, "order_1", 1_000, now_ms).is_empty());
    }
    let stats = engine.stats(APP).unwrap();
    assert_eq!(stats.keys_tracked, 0);
    assert_eq!(stats.hits_received, 100_000);
    assert_eq!(stats.reports_received, 100);
    assert!(engine.top_k(APP, 10, 100).is_empty());
    assert_eq!(hot_events(&report(&mut engine, "pin_1", 1, 100)).len(), 1);
}

#[test]
fn given_rule_reload_when_rule_unchanged_should_keep_counts_and_reset_changed_ones() {
    let keep = rule(prefix("a"), 10_000, 10, 60_000);
    let change = rule(prefix("b"), 10_000, 10, 60_000);
    let mut engine = engine_with(vec![
        keep.clone(),
        change.clone(),
        rule(prefix("c"), 10_000, 10, 60_000),
    ]);
    report(&mut engine, "a1", 5, 1_000);
    report(&mut engine, "b1", 5, 1_000);
    report(&mut engine, "c1", 5, 1_000);
    let changed = Rule {
        description: "only the description changed".to_owned(),
        ..change
    };
    engine.set_rules(APP, vec![changed, keep]).unwrap();
    assert_eq!(
        count_of(&engine, "a1", 1_001),
        5,
        "unchanged rule keeps its count"
    );
    assert_eq!(
        count_of(&engine, "b1", 1_001),
        0,
        "changed rule starts afresh"
    );
    assert_eq!(
        count_of(&engine, "c1", 1_001),
        0,
        "key matching nothing is dropped"
    );
    assert_eq!(engine.stats(APP).unwrap().keys_tracked, 1);
    assert_eq!(hot_events(&report(&mut engine, "a1", 5, 1_002)).len(), 1);
    assert!(report(&mut engine, "b1", 5, 1_002).is_empty());
    assert_eq!(hot_events(&report(&mut engine, "b1", 5, 1_003)).len(), 1);
}

#[test]
fn given_rule_reload_when_key_moves_to_another_rule_should_reset_its_count() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 10_000, 10, 60_000)]);
    report(&mut engine, "pin_1", 8, 1_000);
    engine
        .set_rules(
            APP,
            vec![
                rule(RuleMatch::Default, 10_000, 10, 60_000),
                rule(prefix("pin_"), 10_000, 10, 60_000),
            ],
        )
        .unwrap();
    assert_eq!(count_of(&engine, "pin_1", 1_000), 0);
}

#[test]
fn given_hot_key_when_crossing_again_should_extend_only_below_half_duration() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 10_000, 2, 1_000)]);
    report(&mut engine, "k", 1, 0);
    let events = report(&mut engine, "k", 1, 0);
    assert_eq!(hot_events(&events)[0].hot_until_ms, 1_000);
    assert!(
        report(&mut engine, "k", 1, 100).is_empty(),
        "900 ms left of 1000: no event"
    );
    assert!(
        report(&mut engine, "k", 1, 500).is_empty(),
        "500 ms left is not below half"
    );
    let events = report(&mut engine, "k", 1, 501);
    let hot = hot_events(&events);
    assert_eq!(hot.len(), 1, "499 ms left: extended");
    assert_eq!(hot[0].hot_until_ms, 1_501);
    assert_eq!(hot[0].count, 5);
    assert_eq!(
        engine.stats(APP).unwrap().hot_detected,
        1,
        "an extension is not a new detection"
    );
    let mut events = Vec::new();
    engine.tick(1_000, &mut events);
    assert!(
        events.is_empty(),
        "the first period's end is stale after the extension"
    );
}

#[test]
fn given_hot_key_when_ticked_past_hot_until_should_cool_once() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 1, 2_000)]);
    report(&mut engine, "k", 1, 100);
    assert!(engine.is_hot(APP, b"k", 100));
    let mut events = Vec::new();
    engine.tick(2_099, &mut events);
    assert!(events.is_empty());
    assert_eq!(engine.hot_keys(APP, 2_099).len(), 1);
    engine.tick(2_100, &mut events);
    assert_eq!(
        events,
        vec![Event::Cool {
            app: APP.to_owned(),
            key: b"k".to_vec()
        }]
    );
    engine.tick(5_000, &mut events);
    assert_eq!(events.len(), 1);
    assert!(engine.hot_keys(APP, 2_100).is_empty());
    assert_eq!(engine.stats(APP).unwrap().hot_now, 0);
    assert_eq!(
        engine.stats(APP).unwrap().keys_tracked,
        0,
        "idle key reclaimed"
    );
}

#[test]
fn given_manual_hot_key_when_set_and_removed_should_push_hot_then_cool() {
    let mut engine = engine_with(vec![rule(prefix("pin_"), 1_000, 100, 60_000)]);
    let mut events = Vec::new();
    engine
        .set_manual_hot(APP, b"blocked_user", 5_000, 1_000, &mut events)
        .unwrap();
    assert_eq!(
        events,
        vec![Event::Hot(HotEvent {
            app: APP.to_owned(),
            key: b"blocked_user".to_vec(),
            rule: RuleMatch::Default,
            count: 0,
            hot_until_ms: 6_000,
            source: HotSource::Manual,
        })]
    );
    assert_eq!(engine.hot_keys(APP, 1_000).len(), 1);
    assert_eq!(engine.stats(APP).unwrap().hot_detected, 0);
    events.clear();
    assert!(engine.remove_hot(APP, b"blocked_user", 1_001, &mut events));
    assert_eq!(
        events,
        vec![Event::Cool {
            app: APP.to_owned(),
            key: b"blocked_user".to_vec()
        }]
    );
    assert!(!engine.remove_hot(APP, b"blocked_user", 1_002, &mut events));
    assert!(engine.hot_keys(APP, 1_002).is_empty());
    events.clear();
    engine.tick(10_000, &mut events);
    assert!(
        events.is_empty(),
        "no cool for a key already cooled by hand"
    );
}

#[test]
fn given_manual_hot_key_when_period_ends_should_cool_on_tick() {
    let mut engine = engine_with(vec![rule(prefix("pin_"), 1_000, 100, 60_000)]);
    let mut events = Vec::new();
    engine
        .set_manual_hot(APP, b"pin_7", 500, 0, &mut events)
        .unwrap();
    assert_eq!(hot_events(&events)[0].rule, prefix("pin_"));
    events.clear();
    engine.tick(499, &mut events);
    assert!(events.is_empty());
    engine.tick(500, &mut events);
    assert_eq!(events.len(), 1);
    let error = engine
        .set_manual_hot(APP, b"k", 0, 600, &mut events)
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "app 'shop': hot duration must be between 1 and 86400000 ms, got 0"
    );
}

#[test]
fn given_bad_reports_when_reported_should_refuse_with_named_errors() {
    let mut engine = HotKeyEngine::new(EngineConfig {
        key_bytes_max: 8,
        apps_max: 1,
        ..config()
    });
    let mut events = Vec::new();
    let error = engine.report(APP, b"", 1, 0, &mut events).unwrap_err();
    assert_eq!(
        error,
        ReportError::EmptyKey {
            app: APP.to_owned(),
            max: 8
        }
    );
    assert_eq!(
        error.to_string(),
        "app 'shop': empty key; report keys of 1 to 8 bytes"
    );
    let error = engine
        .report(APP, b"123456789", 1, 0, &mut events)
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "app 'shop': key of 9 bytes is longer than the maximum 8; shorten it or raise key_bytes_max"
    );
    let error = engine
        .report("bad app", b"k", 1, 0, &mut events)
        .unwrap_err();
    assert!(
        matches!(error, ReportError::InvalidApp(RuleError::InvalidApp { .. })),
        "{error}"
    );
    engine.report(APP, b"k", 1, 0, &mut events).unwrap();
    assert_eq!(
        engine.rules(APP),
        Some(vec![Rule::default_rule()]),
        "created with the default rule"
    );
    let error = engine.report("other", b"k", 1, 0, &mut events).unwrap_err();
    assert!(
        matches!(
            error,
            ReportError::InvalidApp(RuleError::TooManyApps { max: 1, .. })
        ),
        "{error}"
    );
    assert!(engine.stats("bad app").is_none());
}

#[test]
fn given_refuse_policy_when_app_unknown_should_refuse_until_rules_are_set() {
    let mut engine = HotKeyEngine::new(EngineConfig {
        unknown_app: UnknownAppPolicy::Refuse,
        ..config()
    });
    let mut events = Vec::new();
    let error = engine.report(APP, b"k", 1, 0, &mut events).unwrap_err();
    assert_eq!(
        error.to_string(),
        "unknown app 'shop'; create it by setting its rules first"
    );
    assert!(engine.apps().is_empty());
    engine
        .set_rules(APP, vec![rule(RuleMatch::Default, 1_000, 1, 1_000)])
        .unwrap();
    engine.report(APP, b"k", 1, 0, &mut events).unwrap();
    assert_eq!(events.len(), 1);
}

#[test]
fn given_invalid_rules_when_set_should_name_rule_field_and_range() {
    let mut engine = HotKeyEngine::new(EngineConfig {
        key_bytes_max: 4,
        ..config()
    });
    let error = engine
        .set_rules(APP, vec![rule(prefix("pin_"), 50, 10, 1_000)])
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "rule prefix 'pin_': window_ms must be between 100 and 600000, got 50"
    );
    let error = engine
        .set_rules(APP, vec![rule(prefix("pin_long"), 1_000, 10, 1_000)])
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "rule prefix 'pin_long': prefix must be 1 to 4 bytes long, got 8 bytes"
    );
    let error = engine
        .set_rules(
            APP,
            vec![
                rule(exact("a"), 1_000, 1, 1_000),
                rule(exact("a"), 2_000, 1, 1_000),
            ],
        )
        .unwrap_err();
    assert_eq!(error.to_string(), "rule key 'a' appears twice; keep one");
    let error = engine.set_rules("", vec![]).unwrap_err();
    assert!(matches!(error, RuleError::InvalidApp { .. }));
    assert!(
        engine.apps().is_empty(),
        "no app created by a refused rule set"
    );
}

#[test]
fn given_keys_with_counts_when_top_k_should_return_highest_first_with_ties_by_key() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 1_000, 60_000)]);
    for (key, count) in [("e", 130), ("b", 300), ("a", 900), ("d", 300), ("c", 200)] {
        report(&mut engine, key, count, 100);
    }
    let top: Vec<(String, u64)> = engine
        .top_k(APP, 3, 100)
        .into_iter()
        .map(|item| (String::from_utf8(item.key).unwrap(), item.count))
        .collect();
    assert_eq!(
        top,
        [
            ("a".to_owned(), 900),
            ("b".to_owned(), 300),
            ("d".to_owned(), 300)
        ]
    );
    assert_eq!(engine.top_k(APP, 10, 100).len(), 5);
    assert!(engine.top_k(APP, 0, 100).is_empty());
    assert!(engine.top_k("nobody", 3, 100).is_empty());
    assert!(engine.top_k(APP, 3, 5_000).is_empty(), "counts expire");
}

#[test]
fn given_admission_above_one_when_key_reaches_it_should_track_with_sketch_credit() {
    // threshold 80 / 8: admission 10.
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 80, 60_000)]);
    for _ in 0..9 {
        report(&mut engine, "k", 1, 100);
    }
    assert_eq!(
        engine.stats(APP).unwrap().keys_tracked,
        0,
        "below admission: sketch only"
    );
    report(&mut engine, "k", 1, 200);
    assert_eq!(count_of(&engine, "k", 200), 10, "credit of 9 plus this hit");
    for _ in 0..69 {
        assert!(report(&mut engine, "k", 1, 300).is_empty());
    }
    assert_eq!(
        hot_events(&report(&mut engine, "k", 1, 300)).len(),
        1,
        "80th hit is hot"
    );
}

#[test]
fn given_sketch_estimate_above_admission_when_admitted_should_cap_credit_below_admission() {
    // One sketch block: every key shares cells, so a new key's estimate is inflated.
    let mut engine = HotKeyEngine::new(EngineConfig {
        sketch_bytes: 64,
        ..config()
    });
    engine
        .set_rules(APP, vec![rule(RuleMatch::Default, 1_000, 80, 60_000)])
        .unwrap();
    for index in 0..200 {
        report(&mut engine, &format!("cold{index}"), 9, 100);
    }
    engine.remove_app("nothing");
    report(&mut engine, "fresh", 1, 100);
    let count = count_of(&engine, "fresh", 100);
    assert!(
        count <= 10,
        "credit is at most admission - 1 = 9, got {count}"
    );
}

#[test]
fn given_tiny_budget_when_many_cold_keys_should_stay_within_budget_and_still_detect_heavy_keys() {
    let sketch_bytes = 64 * 1024;
    let budget = sketch_bytes + 24 * 1024;
    let mut engine = HotKeyEngine::new(EngineConfig {
        sketch_bytes,
        memory_budget_bytes: budget,
        ..config()
    });
    // threshold 8 / 8: admission 1, so every key wants an exact window.
    engine
        .set_rules(APP, vec![rule(RuleMatch::Default, 10_000, 40, 60_000)])
        .unwrap();
    let heavy: Vec<String> = (0..5).map(|index| format!("heavy{index}")).collect();
    let mut detected = std::collections::BTreeSet::new();
    let mut now_ms = 1_000;
    for round in 0..400 {
        for cold in 0..20 {
            let events = report(&mut engine, &format!("cold{round}_{cold}"), 1, now_ms);
            assert!(events.is_empty());
        }
        for key in &heavy {
            for event in hot_events(&report(&mut engine, key, 1, now_ms)) {
                detected.insert(String::from_utf8(event.key.clone()).unwrap());
            }
        }
        assert!(
            engine.memory().used_bytes <= budget,
            "round {round}: {:?}",
            engine.memory()
        );
        now_ms += 10;
    }
    let memory = engine.memory();
    assert!(memory.budget_evictions > 0, "the budget bound: {memory:?}");
    assert!(memory.keys_tracked < 8_000 / 2, "{memory:?}");
    let heavy_set: std::collections::BTreeSet<String> = heavy.into_iter().collect();
    assert_eq!(detected, heavy_set);
}

#[test]
fn given_idle_tracked_keys_when_ticked_should_reclaim_them_but_keep_hot_ones() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 5, 60_000)]);
    report(&mut engine, "idle", 1, 0);
    report(&mut engine, "hot", 5, 0);
    let used = engine.memory().used_bytes;
    let mut events = Vec::new();
    engine.tick(500, &mut events);
    assert_eq!(
        engine.stats(APP).unwrap().keys_tracked,
        2,
        "still counted at 500 ms"
    );
    engine.tick(1_200, &mut events);
    assert_eq!(
        engine.stats(APP).unwrap().keys_tracked,
        1,
        "idle key reclaimed"
    );
    assert!(engine.is_hot(APP, b"hot", 1_200));
    assert!(engine.memory().used_bytes <= used);
}

#[test]
fn given_batch_with_bad_items_when_reported_should_count_good_ones_and_report_rejects() {
    let mut engine = HotKeyEngine::new(EngineConfig {
        key_bytes_max: 4,
        ..config()
    });
    engine
        .set_rules(APP, vec![rule(RuleMatch::Default, 1_000, 3, 1_000)])
        .unwrap();
    let mut events = Vec::new();
    let items: [(&[u8], u32); 4] = [(b"a", 1), (b"", 1), (b"toolong", 1), (b"a", 2)];
    let outcome = engine.report_batch(APP, &items, 10, &mut events).unwrap();
    assert_eq!(outcome.accepted, 2);
    assert_eq!(outcome.rejected, 2);
    assert_eq!(
        outcome.first_error,
        Some(ReportError::EmptyKey {
            app: APP.to_owned(),
            max: 4
        })
    );
    assert_eq!(hot_events(&events).len(), 1);
    let many = vec![(&b"a"[..], 1); REPORT_BATCH_KEYS_MAX + 1];
    let error = engine
        .report_batch(APP, &many, 10, &mut events)
        .unwrap_err();
    assert!(matches!(error, ReportError::BatchTooLarge { .. }));
    let error = engine
        .report_batch("bad app", &items, 10, &mut events)
        .unwrap_err();
    assert!(matches!(error, ReportError::InvalidApp(_)));
}

#[test]
fn given_time_going_backwards_when_reported_should_count_at_the_latest_time() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 8, 60_000)]);
    report(&mut engine, "k", 1, 5_000);
    report(&mut engine, "k", 1, 3_000);
    assert_eq!(count_of(&engine, "k", 5_999), 2);
    assert_eq!(
        count_of(&engine, "k", 3_000),
        2,
        "queries before the clock read it as now"
    );
}

#[test]
fn given_apps_when_listed_and_removed_should_sort_and_forget() {
    let mut engine = HotKeyEngine::new(config());
    let mut events = Vec::new();
    for app in ["zeta", "alpha", "mid"] {
        engine.report(app, b"k", 1, 0, &mut events).unwrap();
    }
    assert_eq!(engine.apps(), ["alpha", "mid", "zeta"]);
    let used = engine.memory().used_bytes;
    assert!(engine.remove_app("alpha"));
    assert!(!engine.remove_app("alpha"));
    assert_eq!(engine.apps(), ["mid", "zeta"]);
    assert!(engine.memory().used_bytes < used);
    assert_eq!(engine.stats("zeta").unwrap().reports_received, 1);
    // Removing an app moves another into its place: reports still reach the right app.
    engine.report("zeta", b"k", 1, 0, &mut events).unwrap();
    engine.report("zeta", b"k", 1, 0, &mut events).unwrap();
    assert_eq!(engine.stats("zeta").unwrap().reports_received, 3);
    assert_eq!(engine.stats("mid").unwrap().reports_received, 1);
    assert!(engine.rules("alpha").is_none());
}

#[test]
fn given_same_stream_when_reported_in_batches_or_one_by_one_should_count_and_detect_the_same() {
    let rules = vec![
        rule(prefix("p"), 1_000, 40, 60_000),
        rule(RuleMatch::Default, 2_000, 200, 60_000),
    ];
    // The same hash seed: the same sketch collisions, so the same admission credits.
    let seeded = EngineConfig {
        hash_seed: Some(42),
        ..config()
    };
    let mut single = HotKeyEngine::new(seeded.clone());
    single.set_rules(APP, rules.clone()).unwrap();
    let mut batched = HotKeyEngine::new(seeded);
    batched.set_rules(APP, rules).unwrap();
    let keys: Vec<String> = (0..300)
        .map(|index| format!("{}{}", ["p", "q"][index % 2], index % 150))
        .collect();
    let mut state = 7_u64;
    let mut single_events = Vec::new();
    let mut batched_events = Vec::new();
    for round in 0..40_u64 {
        let now_ms = 1_000 + round * 37;
        let mut items: Vec<(&[u8], u32)> = Vec::new();
        for _ in 0..150 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Skewed: low indices are hit far more often.
            let index = usize::try_from((state % 300) * (state % 300) / 300).unwrap();
            let count = u32::try_from(state % 3 + 1).unwrap();
            items.push((keys[index].as_bytes(), count));
        }
        for &(key, count) in &items {
            single
                .report(APP, key, count, now_ms, &mut single_events)
                .unwrap();
        }
        let outcome = batched
            .report_batch(APP, &items, now_ms, &mut batched_events)
            .unwrap();
        assert_eq!(outcome.accepted, items.len());
        let mut tick_events = Vec::new();
        single.tick(now_ms, &mut tick_events);
        batched.tick(now_ms, &mut tick_events);
    }
    assert!(!single_events.is_empty(), "the stream makes keys hot");
    assert_eq!(single_events, batched_events);
    assert_eq!(single.top_k(APP, 50, 2_500), batched.top_k(APP, 50, 2_500));
    assert_eq!(single.stats(APP), batched.stats(APP));
}

#[test]
fn given_hot_periods_when_ticked_away_should_return_memory_to_the_start() {
    let mut engine = engine_with(vec![rule(RuleMatch::Default, 1_000, 1, 1_000)]);
    let start = engine.memory().used_bytes;
    for index in 0..100 {
        report(&mut engine, &format!("key{index}"), 1, 0);
    }
    assert!(engine.memory().used_bytes > start);
    let mut events = Vec::new();
    engine.tick(5_000, &mut events);
    assert_eq!(events.len(), 100);
    assert_eq!(engine.memory().keys_tracked, 0);
    assert_eq!(
        std::mem::size_of::<Entry>(),
        192,
        "three cache lines per tracked key"
    );
    // The entry table keeps its capacity; everything else is given back.
    let capacity_bytes = engine.apps[0].entries.capacity() * ENTRY_SLOT_BYTES;
    assert_eq!(engine.memory().used_bytes, start + capacity_bytes);
}

#[test]
fn given_full_budget_when_candidate_offers_more_than_the_lowest_sampled_count_should_evict_else_refuse()
 {
    let sketch_bytes = 64 * 1024;
    let budget = sketch_bytes + 12 * 1024;
    let mut engine = HotKeyEngine::new(EngineConfig {
        sketch_bytes,
        memory_budget_bytes: budget,
        // Admission 1 for a threshold of 1000: every key is tracked from its first hit.
        admission_divisor: 1_000,
        hash_seed: Some(7),
        ..config()
    });
    engine
        .set_rules(APP, vec![rule(RuleMatch::Default, 10_000, 1_000, 60_000)])
        .unwrap();
    let mut filled = 0;
    while engine.memory().budget_evictions == 0 {
        report(&mut engine, &format!("key{filled}"), 5, 1_000);
        filled += 1;
        assert!(filled < 10_000, "the budget never bound");
    }
    let tracked = engine.memory().keys_tracked;
    assert!(tracked > 4, "{tracked} keys fit");
    let refusals = engine.memory().budget_evictions;
    report(&mut engine, "weak", 1, 1_000);
    assert_eq!(engine.memory().keys_tracked, tracked);
    assert_eq!(
        count_of(&engine, "weak", 1_000),
        0,
        "1 hit does not beat counts of 5"
    );
    assert_eq!(engine.memory().budget_evictions, refusals + 1);
    report(&mut engine, "strong", 100, 1_000);
    assert_eq!(
        count_of(&engine, "strong", 1_000),
        100,
        "100 hits evict a key with 5"
    );
    assert_eq!(engine.memory().keys_tracked, tracked);
    assert_eq!(engine.memory().budget_evictions, refusals + 2);
    assert!(engine.memory().used_bytes <= budget);
}

#[test]
fn given_one_app_filling_the_budget_when_another_app_needs_room_should_evict_from_the_big_app() {
    let sketch_bytes = 64 * 1024;
    let budget = sketch_bytes + 48 * 1024;
    let mut engine = HotKeyEngine::new(EngineConfig {
        sketch_bytes,
        memory_budget_bytes: budget,
        admission_divisor: 1_000,
        hash_seed: Some(3),
        ..config()
    });
    let default_rule = rule(RuleMatch::Default, 10_000, 1_000, 60_000);
    engine.set_rules("big", vec![default_rule.clone()]).unwrap();
    engine.set_rules("small", vec![default_rule]).unwrap();
    let mut events = Vec::new();
    let mut filled = 0;
    while engine.memory().budget_evictions == 0 {
        engine
            .report(
                "big",
                format!("key{filled}").as_bytes(),
                5,
                1_000,
                &mut events,
            )
            .unwrap();
        filled += 1;
        assert!(filled < 10_000, "the budget never bound");
    }
    for index in 0..10 {
        let key = format!("small{index}");
        engine
            .report("small", key.as_bytes(), 50, 1_000, &mut events)
            .unwrap();
        let tracked = engine.top_k("small", 100, 1_000);
        assert!(
            tracked.iter().any(|item| item.key == key.as_bytes()),
            "{key} was kept out"
        );
    }
    assert_eq!(
        engine.stats("small").unwrap().keys_tracked,
        10,
        "small never evicts its own"
    );
    assert!(engine.memory().used_bytes <= budget);
}

#[test]
fn given_hot_key_when_its_rule_changes_should_stay_hot_until_its_period_ends_and_count_afresh() {
    let mut engine = engine_with(vec![rule(prefix("pin_"), 1_000, 2, 5_000)]);
    report(&mut engine, "pin_1", 2, 0);
    assert!(engine.is_hot(APP, b"pin_1", 0));
    engine
        .set_rules(APP, vec![rule(prefix("pin_"), 1_000, 3, 5_000)])
        .unwrap();
    assert!(
        engine.is_hot(APP, b"pin_1", 100),
        "still hot after the reload"
    );
    assert_eq!(
        count_of(&engine, "pin_1", 100),
        0,
        "counting afresh under the new rule"
    );
    engine.set_rules(APP, vec![]).unwrap();
    assert_eq!(engine.stats(APP).unwrap().keys_tracked, 1, "kept while hot");
    assert!(
        report(&mut engine, "pin_1", 100, 200).is_empty(),
        "no rule: not counted"
    );
    let mut events = Vec::new();
    engine.tick(5_000, &mut events);
    assert_eq!(events.len(), 1, "cools when its period ends");
    assert_eq!(engine.stats(APP).unwrap().keys_tracked, 0, "then reclaimed");
}

#[test]
fn given_the_server_shares_engines_across_threads_when_compiled_should_be_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<HotKeyEngine>();
    assert_send_sync::<Event>();
}

#[test]
fn given_a_report_older_than_the_engine_clock_when_hot_should_date_it_by_the_engine_clock() {
    // The server's ticker can move a shard's clock past the time a report was stamped with;
    // the hot event is then made at the engine's time, which `now_ms` tells the caller, so
    // the duration it pushes (hot_until - now) is never longer than the rule's.
    let mut engine = engine_with(vec![rule(prefix("pin_"), 1_000, 2, 1_500)]);
    let mut events = Vec::new();
    engine.tick(5_000, &mut events);
    assert_eq!(engine.now_ms(), 5_000);
    let events = report(&mut engine, "pin_1", 3, 4_990);
    let hot = hot_events(&events);
    assert_eq!(hot.len(), 1);
    assert_eq!(engine.now_ms(), 5_000, "the clock never goes back");
    assert_eq!(hot[0].hot_until_ms - engine.now_ms(), 1_500);
}
