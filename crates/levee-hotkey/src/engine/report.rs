//! The hot path: counting reports. [`HotKeyEngine::report`] and [`HotKeyEngine::report_batch`]
//! (with its limit and its [`BatchOutcome`]) check the key, resolve the app (creating it if the
//! policy allows) and count: a tracked key adds to its window and may turn hot; an untracked key
//! goes to the sketch and, once its estimate reaches its rule's admission, gets an exact window
//! within the memory budget.

use std::hash::BuildHasher;

use crate::app::{Entry, NO_RULE};
use crate::key_bytes::KeyBytes;
use crate::rule::Rule;
use crate::rule_set::RuleSet;
use crate::window::Window;

use super::{Event, HotKeyEngine, HotSource, ReportError, UnknownAppPolicy};

/// Most items in one [`HotKeyEngine::report_batch`] call.
pub const REPORT_BATCH_KEYS_MAX: usize = 65_536;

/// Items of a batch whose memory loads are started together (see
/// [`HotKeyEngine::report_batch`]).
const BATCH_CHUNK_ITEMS: usize = 64;

/// What [`HotKeyEngine::report_batch`] did with a batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Items counted (including those whose key matched no rule).
    pub accepted: usize,
    /// Items skipped because their key was empty or too long.
    pub rejected: usize,
    /// Why the first skipped item was skipped.
    pub first_error: Option<ReportError>,
}

impl HotKeyEngine {
    /// Counts `count` hits of `key` at `now_ms`; pushes a [`Event::Hot`] when the key turns hot
    /// (or its hot period is extended).
    pub fn report(
        &mut self,
        app: &str,
        key: &[u8],
        count: u32,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<(), ReportError> {
        self.check_key(app, key)?;
        let now_ms = self.advance_clock(now_ms);
        let position = self.resolve_app(app)?;
        self.report_resolved(position, key, count, now_ms, events);
        Ok(())
    }

    /// Counts a batch of `(key, count)` reports of one app at `now_ms`, resolving the app once.
    ///
    /// Errors that concern the whole batch (unknown or invalid app, more than
    /// [`REPORT_BATCH_KEYS_MAX`] items) refuse it whole and count nothing. Items with an empty or
    /// too long key are skipped and counted in [`BatchOutcome::rejected`], with the first one's
    /// error in [`BatchOutcome::first_error`]; the other items are counted.
    pub fn report_batch(
        &mut self,
        app: &str,
        items: &[(&[u8], u32)],
        now_ms: u64,
        events: &mut Vec<Event>,
    ) -> Result<BatchOutcome, ReportError> {
        if items.len() > REPORT_BATCH_KEYS_MAX {
            return Err(ReportError::BatchTooLarge {
                app: app.to_owned(),
                items: items.len(),
                max: REPORT_BATCH_KEYS_MAX,
            });
        }
        let now_ms = self.advance_clock(now_ms);
        let position = self.resolve_app(app)?;
        let mut outcome = BatchOutcome::default();
        let mut hashes = [0_u64; BATCH_CHUNK_ITEMS];
        let mut untracked = [false; BATCH_CHUNK_ITEMS];
        for chunk in items.chunks(BATCH_CHUNK_ITEMS) {
            untracked.fill(false);
            // Three short passes start the chunk's memory loads (key hashes, table and entries,
            // then the sketch blocks of keys that are not tracked) so that their cache misses
            // overlap, instead of being paid one after another when the reports are counted.
            let state = &self.apps[position];
            for (hash, &(key, _)) in hashes.iter_mut().zip(chunk) {
                *hash = self.hasher.hash_one(key);
            }
            let mut touched = 0_u64;
            for ((missing, &hash), &(key, _)) in untracked.iter_mut().zip(&hashes).zip(chunk) {
                match state.find(hash, key) {
                    Some(entry) => touched ^= state.entries[entry].window.touch(),
                    None => *missing = true,
                }
            }
            for (&missing, &hash) in untracked.iter().zip(&hashes).take(chunk.len()) {
                if missing {
                    touched ^= u64::from(self.sketch.touch(hash ^ state.seed));
                }
            }
            std::hint::black_box(touched);
            for (&hash, &(key, count)) in hashes.iter().zip(chunk) {
                if key.is_empty() || key.len() > self.config.key_bytes_max {
                    outcome.rejected += 1;
                    if outcome.first_error.is_none() {
                        outcome.first_error = self.check_key(app, key).err();
                    }
                    continue;
                }
                outcome.accepted += 1;
                self.report_hashed(position, key, hash, count, now_ms, events);
            }
        }
        Ok(outcome)
    }

    pub(super) fn check_key(&self, app: &str, key: &[u8]) -> Result<(), ReportError> {
        if key.is_empty() {
            return Err(ReportError::EmptyKey {
                app: app.to_owned(),
                max: self.config.key_bytes_max,
            });
        }
        if key.len() > self.config.key_bytes_max {
            return Err(ReportError::KeyTooLong {
                app: app.to_owned(),
                length: key.len(),
                max: self.config.key_bytes_max,
            });
        }
        Ok(())
    }

    /// The app's position, creating it with the default rule if the policy allows.
    #[inline]
    pub(super) fn resolve_app(&mut self, app: &str) -> Result<usize, ReportError> {
        if let Some(state) = self.apps.get(self.last_app_position)
            && *state.name == *app
        {
            return Ok(self.last_app_position);
        }
        if let Some(&position) = self.app_positions.get(app) {
            self.last_app_position = position;
            return Ok(position);
        }
        if self.config.unknown_app == UnknownAppPolicy::Refuse {
            return Err(ReportError::UnknownApp {
                app: app.to_owned(),
            });
        }
        crate::rule::validate_app_name(app)?;
        let rules = RuleSet::new(
            app,
            vec![Rule::default_rule()],
            self.config.key_bytes_max,
            self.config.admission_divisor,
        )?;
        let position = self.create_app(app, rules)?;
        self.update_sketch_generation();
        Ok(position)
    }

    /// The hot path: one report of a resolved app, key already checked, clock advanced.
    #[inline]
    fn report_resolved(
        &mut self,
        position: usize,
        key: &[u8],
        count: u32,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) {
        let hash = self.hasher.hash_one(key);
        self.report_hashed(position, key, hash, count, now_ms, events);
    }

    /// [`HotKeyEngine::report_resolved`] with the key's hash already computed.
    #[inline]
    fn report_hashed(
        &mut self,
        position: usize,
        key: &[u8],
        hash: u64,
        count: u32,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) {
        let state = &mut self.apps[position];
        state.reports_received += 1;
        state.hits_received += u64::from(count);
        if count == 0 {
            return;
        }
        if let Some(entry_position) = state.find(hash, key) {
            let entry = &mut state.entries[entry_position];
            if entry.rule == NO_RULE {
                return;
            }
            let rule = state.rules.get(entry.rule);
            let total = entry
                .window
                .add(u64::from(count), now_ms, rule.window_ms, rule.slot_ms);
            if total >= rule.rule.threshold
                && entry.hot_until_ms.saturating_sub(now_ms).saturating_mul(2)
                    < rule.rule.hot_duration_ms
            {
                let duration_ms = rule.rule.hot_duration_ms;
                self.make_hot(
                    position,
                    entry_position,
                    total,
                    now_ms,
                    duration_ms,
                    HotSource::Detected,
                    events,
                );
            }
            return;
        }
        let Some(rule_index) = state.rules.find(key) else {
            return;
        };
        let rule = state.rules.get(rule_index);
        let count = u64::from(count);
        // Every untracked hit goes to the sketch, even for rules whose admission is 1 (tracked
        // from their first hit): the estimate is what a key offers against a victim when the
        // budget binds.
        self.sketch.rotate_if_due(now_ms);
        let before = self
            .sketch
            .add(hash ^ state.seed, u32::try_from(count).unwrap_or(u32::MAX));
        if before + count < rule.admission {
            return;
        }
        // The key's true hits within its window before this report are below its admission
        // (see the crate docs), so capping the credit keeps the count from undercounting while
        // bounding how much it can overcount.
        let credit = before.min(rule.admission - 1);
        let estimate = before + count;
        let (window_ms, slot_ms, threshold, duration_ms) = (
            rule.window_ms,
            rule.slot_ms,
            rule.rule.threshold,
            rule.rule.hot_duration_ms,
        );
        let entry = Entry {
            key: KeyBytes::from(key),
            hash,
            window: Window::new(credit + count, now_ms, window_ms, slot_ms),
            rule: rule_index,
            hot_until_ms: 0,
        };
        let Some(entry_position) = self.insert_within_budget(position, entry, estimate, now_ms)
        else {
            return;
        };
        if credit + count >= threshold {
            self.make_hot(
                position,
                entry_position,
                credit + count,
                now_ms,
                duration_ms,
                HotSource::Detected,
                events,
            );
        }
    }
}
