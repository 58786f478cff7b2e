//! [`LeaseAllocator`]: the cluster mode's budget without an RPC per call (issue 37). Clients
//! hold leases of tokens and decide locally; every lease period (`window_ns`, 100 ms by
//! default) each client asks for its next lease, saying how many tokens it wants (its recent
//! demand). The allocator hands out each window's budget:
//!
//! - **Never over the budget.** Window k (the `window_ns` starting at `k x window_ns`) has the
//!   budget `floor((k + 1) x B) - floor(k x B)` with `B = permits x window_ns / period_ns`, so
//!   the windows of any interval of length D hold at most `permits x D / period + B + 1` tokens
//!   (the `B` for a partial window at each end), and a window's grants never pass its budget.
//!   Tokens of a lease are valid only until the end of its window: unused ones are not carried,
//!   so a cap can only be missed from below.
//! - **Ahead of time.** A request in the last fifth of a window is for the next window (its
//!   lease starts then), so a client that asks a little before its lease runs out always holds
//!   one.
//! - **Fair.** A client gets at most its max-min fair share of the window's budget over the
//!   demands of the clients heard from in the last two windows (a client asking for less than
//!   its share leaves the rest to the others), and never more than what is left in the window.
//!   A client over its share gets its share: that is the documented answer, not an error.
//! - **Bounded.** At most `clients_max` clients are remembered; clients not heard from for two
//!   windows are forgotten first; a new client beyond the bound is granted nothing
//!   ([`Grant::refused`]) until room frees.
//!
//! The shortfall (budget not handed out) comes from clients asking after the window's budget
//! went to others and from demand that changes within a window; the load tool measures it.

use std::collections::{BTreeMap, HashMap};

use crate::{NANOS_PER_S, Nanos, RuleError};

/// A client's id, chosen by the client (unique per resource).
pub type ClientId = u64;

/// The budget of one resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRule {
    /// Tokens per period over all clients: at least 1.
    pub permits: u64,
    /// The period: 1 s to a day (a minute for "per minute").
    pub period_ns: u64,
    /// The lease period: 10 ms to 10 s.
    pub window_ns: u64,
    /// Clients remembered at once: 1 to 1,000,000.
    pub clients_max: usize,
}

impl LeaseRule {
    /// `permits` a minute in leases of 100 ms, up to 100,000 clients.
    pub fn per_minute(permits: u64) -> Self {
        Self {
            period_ns: 60 * NANOS_PER_S,
            ..Self::per_second(permits)
        }
    }

    /// `permits` a second in leases of 100 ms, up to 100,000 clients.
    pub fn per_second(permits: u64) -> Self {
        Self {
            permits,
            period_ns: NANOS_PER_S,
            window_ns: 100_000_000,
            clients_max: 100_000,
        }
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), RuleError> {
        if self.permits == 0 {
            return Err(RuleError::NotPositive {
                field: "permits",
                got: 0,
            });
        }
        if !(NANOS_PER_S..=86_400 * NANOS_PER_S).contains(&self.period_ns) {
            return Err(RuleError::OutOfRange {
                field: "period_ns",
                got: self.period_ns,
                min: NANOS_PER_S,
                max: 86_400 * NANOS_PER_S,
                fix: "give a period from 1 s to a day",
            });
        }
        if !(10_000_000..=10 * NANOS_PER_S).contains(&self.window_ns) {
            return Err(RuleError::OutOfRange {
                field: "window_ns",
                got: self.window_ns,
                min: 10_000_000,
                max: 10 * NANOS_PER_S,
                fix: "give a lease period from 10 ms to 10 s",
            });
        }
        if !(1..=1_000_000).contains(&self.clients_max) {
            return Err(RuleError::OutOfRange {
                field: "clients_max",
                got: self.clients_max as u64,
                min: 1,
                max: 1_000_000,
                fix: "remember 1 to 1,000,000 clients",
            });
        }
        Ok(())
    }
}

/// A lease: tokens to spend from its start until the end of its window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens granted.
    pub permits: u64,
    /// When they may be spent from: now, or the next window's start for a request made in the
    /// last fifth of a window.
    pub starts_at: Nanos,
    /// When they expire (the end of the window).
    pub expires_at: Nanos,
    /// True when the client was granted nothing because too many clients are remembered.
    pub refused: bool,
}

#[derive(Debug, Clone, Copy)]
struct Client {
    demand: u64,
    last_window: u64,
    /// Tokens granted to it in `last_window`.
    granted: u64,
}

/// Hands out one resource's budget as leases.
#[derive(Debug, Clone)]
pub struct LeaseAllocator {
    rule: LeaseRule,
    /// Tokens granted per window (the current one and the next, at most).
    granted: BTreeMap<u64, u64>,
    clients: HashMap<ClientId, Client>,
}

/// A request within the last `window_ns / PREFETCH_DIVISOR` of a window is for the next one.
pub const PREFETCH_DIVISOR: u64 = 5;

impl LeaseAllocator {
    /// An allocator of `rule`.
    pub fn new(rule: LeaseRule) -> Result<Self, RuleError> {
        rule.validate()?;
        Ok(Self {
            rule,
            granted: BTreeMap::new(),
            clients: HashMap::new(),
        })
    }

    /// Replaces the rule (from the next window on).
    pub fn set_rule(&mut self, rule: LeaseRule) -> Result<(), RuleError> {
        rule.validate()?;
        self.rule = rule;
        Ok(())
    }

    /// The rule.
    pub fn rule(&self) -> LeaseRule {
        self.rule
    }

    /// Tokens granted so far for window `window` (0 for a window long gone).
    pub fn granted(&self, window: u64) -> u64 {
        self.granted.get(&window).copied().unwrap_or(0)
    }

    /// The budget of window `window`.
    pub fn budget(&self, window: u64) -> u64 {
        let cumulative = |windows: u64| {
            u128::from(windows) * u128::from(self.rule.permits) * u128::from(self.rule.window_ns)
                / u128::from(self.rule.period_ns)
        };
        u64::try_from(cumulative(window + 1) - cumulative(window)).unwrap_or(u64::MAX)
    }

    /// Clients remembered now.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Clients that asked for a lease of the current window or the one before, at `now`.
    pub fn active_clients(&self, now: Nanos) -> usize {
        let recent = (now / self.rule.window_ns).saturating_sub(1);
        self.clients
            .values()
            .filter(|known| known.last_window >= recent)
            .count()
    }

    /// Client `client` asks at `now` for a lease of up to `demand` tokens.
    pub fn request(&mut self, client: ClientId, demand: u64, now: Nanos) -> Grant {
        let window_ns = self.rule.window_ns;
        let current = now / window_ns;
        // Near a window's end a request is for the next window: the client gets its lease
        // before the current one runs out, and spends it over the whole window.
        let window = if window_ns - now % window_ns <= window_ns / PREFETCH_DIVISOR {
            current + 1
        } else {
            current
        };
        let starts_at = now.max(window.saturating_mul(window_ns));
        let expires_at = (window + 1).saturating_mul(window_ns);
        self.granted.retain(|known, _| *known >= current);
        let recent = window.saturating_sub(1);
        if !self.clients.contains_key(&client) && self.clients.len() >= self.rule.clients_max {
            self.clients.retain(|_, known| known.last_window >= recent);
            if self.clients.len() >= self.rule.clients_max {
                return Grant {
                    permits: 0,
                    starts_at,
                    expires_at,
                    refused: true,
                };
            }
        }
        let entry = self.clients.entry(client).or_insert(Client {
            demand,
            last_window: window,
            granted: 0,
        });
        if entry.last_window != window {
            entry.granted = 0;
        }
        entry.demand = demand;
        entry.last_window = window;
        let already = entry.granted;
        let budget = self.budget(window);
        let granted = self.granted.get(&window).copied().unwrap_or(0);
        let demands: Vec<u64> = self
            .clients
            .values()
            .filter(|known| known.last_window >= recent)
            .map(|known| known.demand)
            .collect();
        let share = fair_share(budget, &demands, demand);
        let permits = share.saturating_sub(already).min(budget - granted);
        self.granted.insert(window, granted + permits);
        if let Some(entry) = self.clients.get_mut(&client) {
            entry.granted += permits;
        }
        Grant {
            permits,
            starts_at,
            expires_at,
            refused: false,
        }
    }
}

/// The max-min fair share of `budget` for a client demanding `demand` among `demands` (which
/// include it): every demand below the water level is met in full, the rest share what is left
/// equally.
fn fair_share(budget: u64, demands: &[u64], demand: u64) -> u64 {
    let mut sorted = demands.to_vec();
    sorted.sort_unstable();
    let mut left = budget;
    let mut remaining = sorted.len() as u64;
    for wanted in sorted {
        let equal = left / remaining.max(1);
        if wanted >= equal {
            return demand.min(equal);
        }
        left -= wanted;
        remaining -= 1;
    }
    // Every demand fits under the water level.
    demand
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn given_uneven_demand_then_small_demands_are_met_and_big_ones_share_the_rest() {
        // 1,000/s in 100 ms leases: 100 tokens a window.
        let mut leases = LeaseAllocator::new(LeaseRule::per_second(1_000)).unwrap();
        // The first round learns the demands; the second is fair over them.
        for (client, demand) in [(1, 10), (2, 500), (3, 500)] {
            leases.request(client, demand, 0);
        }
        let grants: Vec<u64> = [(1, 10), (2, 500), (3, 500)]
            .iter()
            .map(|(client, demand)| leases.request(*client, *demand, 100 * MS).permits)
            .collect();
        assert_eq!(grants, [10, 45, 45]);
        assert_eq!(
            leases.request(2, 500, 150 * MS).permits,
            0,
            "its share is spent"
        );
    }

    #[test]
    fn given_a_budget_that_does_not_divide_then_windows_add_up_exactly() {
        let leases = LeaseAllocator::new(LeaseRule::per_second(15)).unwrap();
        // 1.5 tokens a window: 1, 2, 1, 2, ...
        let budgets: Vec<u64> = (0..4).map(|window| leases.budget(window)).collect();
        assert_eq!(budgets, [1, 2, 1, 2]);
    }

    #[test]
    fn given_too_many_clients_then_a_new_one_is_refused_until_old_ones_are_forgotten() {
        let mut rule = LeaseRule::per_second(1_000);
        rule.clients_max = 2;
        let mut leases = LeaseAllocator::new(rule).unwrap();
        leases.request(1, 10, 0);
        leases.request(2, 10, 0);
        assert!(leases.request(3, 10, 0).refused);
        // Two windows later 1 and 2 are forgotten.
        assert!(!leases.request(3, 10, 300 * MS).refused);
        assert_eq!(leases.clients(), 1);
    }

    #[test]
    fn given_bad_rules_then_the_error_names_the_field() {
        let mut rule = LeaseRule::per_second(0);
        assert!(rule.validate().unwrap_err().to_string().contains("permits"));
        rule = LeaseRule::per_second(1);
        rule.window_ns = MS;
        assert!(
            rule.validate()
                .unwrap_err()
                .to_string()
                .contains("window_ns")
        );
    }
}
