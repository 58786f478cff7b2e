//! Levee's hot-key engine: counts the keys app servers report in sliding windows against
//! per-app rules and says when a key turns hot or cools down. It does no I/O and reads no
//! clock: every call takes the current time in milliseconds, so tests drive it with virtual
//! time. `docs/HOTKEY.md` says the same at more length, with measured throughput.
//!
//! # Parts
//!
//! - [`rule`]: [`Rule`]s per app: match (exact key, prefix, or the default `*`), window,
//!   threshold, hot duration; validated with errors that name the rule, the field and the range.
//! - [`engine`]: [`HotKeyEngine`], which takes reports and emits [`Event`]s. Inside it:
//!   - a rule set per app, compiled for matching: exact key, then the longest matching prefix,
//!     then `*`; a key that matches no rule is not counted;
//!   - a shared Count-Min sketch (the heavy-hitter prefilter, conservative update, two
//!     generations, one cache line per key) that every report of an untracked key goes to;
//!   - per app, a table of tracked keys, each with an exact sliding window of 10 time slots
//!     and its hot state; a hot set and a queue of hot periods' ends.
//!
//! # How a report flows
//!
//! 1. The key is checked (1 to `key_bytes_max` bytes) and the app resolved (created with
//!    [`Rule::default_rule`] if [`UnknownAppPolicy::Create`]).
//! 2. A tracked key adds its count to its window's newest slot (O(1); slots that left the
//!    window are dropped lazily) and, if the window count reaches the rule's threshold, turns
//!    hot.
//! 3. An untracked key finds its rule (none: stop), adds its count to the sketch and, once the
//!    sketch estimate reaches the rule's *admission* `A = max(1, threshold / admission_divisor)`,
//!    gets an exact window that starts with a *credit* `min(estimate before this report, A - 1)`
//!    plus this report's count, in the current slot. Keys whose admission is 1 (threshold up to
//!    the divisor, 8 by default) are tracked exactly from their first hit.
//! 4. Admission needs memory from the budget; when the budget binds, sampled tracked keys
//!    with lower window counts than the candidate's estimate are evicted (from the key's own
//!    app if it holds its fair share of the budget, else from the app holding the most), or the
//!    candidate is kept out (both counted in [`MemoryStats::budget_evictions`]).
//!
//! # Counting and its error bound
//!
//! A rule's window of `W` ms is cut into slots of `S = max(10, W / 10)` ms aligned to multiples
//! of `S`. A key's window count at `now` is its credit (while the credit's slot overlaps the
//! window) plus the hits since it was admitted in the slots that overlap `(now - W, now]`.
//! With `T` the threshold and `A` the admission:
//!
//! - **No false negatives.** If at a report time `t` a key has at least `T` hits in
//!   `(t - W, t]`, it is hot after that report (a [`Event::Hot`] at `t`, or hot already).
//!   This holds while the budget has neither evicted nor refused the key (no change in
//!   `budget_evictions` is a sufficient sign) and for hits since its rule last changed. Why:
//!   slots never drop a hit inside the window; the sketch never underestimates; and a key that
//!   is not tracked has fewer than `A` hits in its window (otherwise it would have been
//!   admitted; an idle key is reclaimed only with a window count of 0), so the credit covers
//!   every hit before admission.
//! - **Bounded false positives.** A [`HotSource::Detected`] event at `t` implies at least
//!   `T - A + 1` hits in `(t - W - S, t]`. This holds always, budget binding or not: slots hold
//!   only hits of the last `W + S` ms and the credit is at most `A - 1`. With `A = 1` the count
//!   is exact up to slot granularity: at least `T` hits in `(t - W - S, t]`.
//! - Counts in events and [`HotKeyEngine::top_k`] lie between the hits in `(t - W, t]` and the
//!   hits in `(t - W - S, t]` plus `A - 1`.
//!
//! The sketch is shared by all apps and rotates every longest window of any app, so it always
//! remembers at least one full window of every rule.
//!
//! # Hot and cool
//!
//! A key turns hot when its count reaches the threshold: [`Event::Hot`] with
//! `hot_until_ms = now + hot_duration_ms`. While hot, further crossings emit nothing unless less
//! than half of the duration is left, when the hot period is extended and a new event emitted.
//! [`HotKeyEngine::tick`] emits [`Event::Cool`] for keys whose period ended; manual hot keys
//! ([`HotKeyEngine::set_manual_hot`]) and [`HotKeyEngine::remove_hot`] push the same events.
//!
//! # Example
//!
//! ```
//! use levee_hotkey::{EngineConfig, Event, HotKeyEngine, Rule, RuleMatch};
//!
//! let mut engine = HotKeyEngine::new(EngineConfig::default());
//! let pins = Rule {
//!     matcher: RuleMatch::Prefix(b"pin_".to_vec()),
//!     window_ms: 2_000,
//!     threshold: 20,
//!     hot_duration_ms: 60_000,
//!     description: "20 hits in 2 s".to_owned(),
//! };
//! engine.set_rules("shop", vec![pins, Rule::default_rule()])?;
//! let mut events = Vec::new();
//! let items: Vec<(&[u8], u32)> = vec![(b"pin_42", 15), (b"order_7", 3)];
//! engine.report_batch("shop", &items, 1_000, &mut events)?;
//! assert!(events.is_empty());
//! engine.report("shop", b"pin_42", 5, 1_500, &mut events)?;
//! assert!(matches!(&events[0], Event::Hot(hot) if hot.key == b"pin_42" && hot.hot_until_ms == 61_500));
//! engine.tick(61_500, &mut events);
//! assert!(matches!(&events[1], Event::Cool { key, .. } if key == b"pin_42"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod app;
pub mod engine;
mod key_bytes;
pub mod rule;
mod rule_set;
mod sketch;
mod window;

pub use engine::{
    AppStats, BatchOutcome, EngineConfig, Event, HotEvent, HotKeyEngine, HotSource, KeyCount,
    MemoryStats, REPORT_BATCH_KEYS_MAX, ReportError, UnknownAppPolicy,
};
pub use rule::{
    APP_NAME_BYTES_MAX, HOT_DURATION_MS_MAX, HOT_DURATION_MS_MIN, Rule, RuleError, RuleMatch,
    validate_app_name,
};
