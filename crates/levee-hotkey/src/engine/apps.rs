//! Apps and their rules: replacing an app's rules ([`HotKeyEngine::set_rules`], which keeps the
//! counts of keys whose rule did not change), reading them, listing and removing apps, creating
//! an app within `apps_max`, and keeping the sketch's generation as long as the longest window
//! of any app.

use crate::app::{App, NO_RULE};
use crate::rule::{Rule, RuleError};
use crate::rule_set::RuleSet;
use crate::window::Window;

use super::{GENERATION_MS_DEFAULT, HotKeyEngine};

impl HotKeyEngine {
    /// Replaces an app's rules (creating the app). Keys whose rule did not change keep their
    /// counts; keys whose rule changed start counting afresh under the new rule.
    ///
    /// A key's rule "did not change" when the rule that matches it under the new rules is equal,
    /// field for field, to the one that matched it before. Keys that now match another rule (or
    /// a changed one) lose their window; keys that match nothing are dropped. Hot keys stay hot
    /// until their hot period ends.
    pub fn set_rules(&mut self, app: &str, rules: Vec<Rule>) -> Result<(), RuleError> {
        crate::rule::validate_app_name(app)?;
        let rule_set = RuleSet::new(
            app,
            rules,
            self.config.key_bytes_max,
            self.config.admission_divisor,
        )?;
        let position = match self.app_positions.get(app) {
            Some(&position) => position,
            None => self.create_app(app, RuleSet::default())?,
        };
        let now_ms = self.clock_ms;
        let state = &mut self.apps[position];
        let old_rules = std::mem::replace(&mut state.rules, rule_set);
        let mut kept = Vec::with_capacity(state.entries.len());
        let mut dropped_key_bytes = 0;
        for mut entry in state.entries.drain(..) {
            let new_rule = state.rules.find(&entry.key);
            let unchanged = entry.rule != NO_RULE
                && new_rule.is_some_and(|new_rule| {
                    state.rules.get(new_rule).rule == old_rules.get(entry.rule).rule
                });
            if unchanged {
                entry.rule = new_rule.unwrap_or(NO_RULE);
                kept.push(entry);
            } else if entry.hot_until_ms != 0 {
                entry.rule = new_rule.unwrap_or(NO_RULE);
                entry.window = match new_rule {
                    Some(rule) => {
                        let rule = state.rules.get(rule);
                        Window::new(0, now_ms, rule.window_ms, rule.slot_ms)
                    }
                    None => Window::new(0, now_ms, 1_000, 100),
                };
                kept.push(entry);
            } else {
                dropped_key_bytes += entry.key.heap_bytes();
            }
        }
        state.entries = kept;
        state.key_bytes -= dropped_key_bytes;
        state.reclaim_cursor = 0;
        state.rebuild_index();
        self.refresh_bytes(position);
        self.update_sketch_generation();
        Ok(())
    }

    /// An app's rules, or `None` if the app does not exist.
    pub fn rules(&self, app: &str) -> Option<Vec<Rule>> {
        self.app(app).map(|state| state.rules.rules())
    }

    /// The apps, sorted.
    pub fn apps(&self) -> Vec<String> {
        let mut names: Vec<String> = self.apps.iter().map(|app| app.name.to_string()).collect();
        names.sort_unstable();
        names
    }

    /// Removes an app and all its state. Returns whether it existed. No cool events are
    /// emitted for its hot keys.
    pub fn remove_app(&mut self, app: &str) -> bool {
        let Some(position) = self.app_positions.remove(app) else {
            return false;
        };
        self.last_app_position = usize::MAX;
        let removed = self.apps.swap_remove(position);
        self.used_bytes -= removed.bytes;
        if let Some(moved) = self.apps.get(position)
            && let Some(slot) = self.app_positions.get_mut(&*moved.name)
        {
            *slot = position;
        }
        self.update_sketch_generation();
        true
    }

    pub(super) fn create_app(&mut self, app: &str, rules: RuleSet) -> Result<usize, RuleError> {
        if self.apps.len() >= self.config.apps_max {
            return Err(RuleError::TooManyApps {
                app: app.to_owned(),
                max: self.config.apps_max,
            });
        }
        let seed = self.next_app_seed;
        self.next_app_seed = self.next_app_seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let state = App::new(app, seed, rules);
        self.used_bytes += state.bytes;
        let position = self.apps.len();
        self.apps.push(state);
        self.app_positions.insert(app.into(), position);
        Ok(position)
    }

    /// The sketch must remember the longest window of any app.
    pub(super) fn update_sketch_generation(&mut self) {
        let window_ms_max = self
            .apps
            .iter()
            .map(|app| app.rules.window_ms_max())
            .max()
            .unwrap_or(0);
        let generation_ms = if window_ms_max == 0 {
            GENERATION_MS_DEFAULT
        } else {
            window_ms_max
        };
        self.sketch.set_generation_ms(generation_ms);
    }
}
