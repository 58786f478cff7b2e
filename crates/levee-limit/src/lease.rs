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
    /// Tokens added to the client's lease of the window now running (valid until `starts_at`),
    /// for a request for the next window from a client whose current lease fell short of its
    /// demand: what others gave back and the budget left unallocated.
    pub top_up: u64,
}

#[derive(Debug, Clone, Copy)]
struct Client {
    demand: u64,
    last_window: u64,
    /// Tokens granted to it in `last_window`.
    granted: u64,
    /// Whether that grant fell short of its demand.
    short: bool,
}

/// Hands out one resource's budget as leases.
#[derive(Debug, Clone)]
pub struct LeaseAllocator {
    rule: LeaseRule,
    /// Per window (the current one and the next, at most): its budget, fixed when the window
    /// is first asked for, and the tokens granted of it.
    granted: BTreeMap<u64, (u64, u64)>,
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

    /// Replaces the rule: windows already asked for keep their budget (their leases are out),
    /// so the new one applies from the first window nobody has asked for yet (at most two
    /// windows on).
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
        self.granted.get(&window).map_or(0, |(_, granted)| *granted)
    }

    /// The budget of window `window`: as fixed when it was first asked for, or as the rule
    /// gives it.
    pub fn budget(&self, window: u64) -> u64 {
        self.granted
            .get(&window)
            .map_or_else(|| self.rule_budget(window), |(budget, _)| *budget)
    }

    /// The budget the current rule gives window `window`.
    pub fn rule_budget(&self, window: u64) -> u64 {
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
        self.request_returning(client, demand, 0, now)
    }

    /// As [`Self::request`], the client also giving back `returned` tokens of its lease of the
    /// window now running, which it will not spend. Only a request for the next window (in the
    /// last fifth of the current one) gives back, at most what the client was granted for the
    /// current window; what is given back may be granted again as top-ups of the current
    /// window to clients whose leases fell short, so a window's grants still never pass its
    /// budget.
    pub fn request_returning(
        &mut self,
        client: ClientId,
        demand: u64,
        returned: u64,
        now: Nanos,
    ) -> Grant {
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
                    top_up: 0,
                };
            }
        }
        let top_up = if window == current + 1 {
            self.settle_current(client, demand, returned, now)
        } else {
            0
        };
        let entry = self.clients.entry(client).or_insert(Client {
            demand,
            last_window: window,
            granted: 0,
            short: false,
        });
        if entry.last_window != window {
            entry.granted = 0;
        }
        entry.demand = demand;
        entry.last_window = window;
        let already = entry.granted;
        let (budget, granted) = self.window(window);
        let demands: Vec<u64> = self
            .clients
            .values()
            .filter(|known| known.last_window >= recent)
            .map(|known| known.demand)
            .collect();
        let share = fair_share(budget, &demands, demand);
        let permits = share
            .saturating_sub(already)
            .min(budget.saturating_sub(granted));
        self.granted.insert(window, (budget, granted + permits));
        if let Some(entry) = self.clients.get_mut(&client) {
            entry.granted += permits;
            entry.short = entry.granted < demand;
        }
        Grant {
            permits,
            starts_at,
            expires_at,
            refused: false,
            top_up,
        }
    }

    /// Window `window`'s budget and what is granted of it, its budget fixed from now on.
    fn window(&mut self, window: u64) -> (u64, u64) {
        let budget = self.rule_budget(window);
        *self.granted.entry(window).or_insert((budget, 0))
    }

    /// A client asking for the next window settles the current one: it gives back `returned`
    /// tokens (at most its grant), and, if its grant fell short of its demand, is topped up
    /// with what is left of the window's budget, up to its demand's rate over the rest of the
    /// window. Returns the top-up.
    fn settle_current(&mut self, client: ClientId, demand: u64, returned: u64, now: Nanos) -> u64 {
        let window_ns = self.rule.window_ns;
        let current = now / window_ns;
        let Some(known) = self.clients.get(&client) else {
            return 0;
        };
        if known.last_window != current {
            return 0;
        }
        let (budget, _) = self.window(current);
        let Some(known) = self.clients.get_mut(&client) else {
            return 0;
        };
        let Some((_, held)) = self.granted.get_mut(&current) else {
            return 0;
        };
        let back = returned.min(known.granted).min(*held);
        known.granted -= back;
        *held -= back;
        if !known.short {
            return 0;
        }
        let rest_ns = (current + 1).saturating_mul(window_ns).saturating_sub(now);
        let wanted = u128::from(demand) * u128::from(rest_ns) / u128::from(window_ns) + 1;
        let top_up = budget
            .saturating_sub(*held)
            .min(u64::try_from(wanted).unwrap_or(u64::MAX));
        *held += top_up;
        known.granted += top_up;
        top_up
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
    fn given_tokens_given_back_then_a_client_that_fell_short_is_topped_up_within_the_budget() {
        // 100 tokens a window; a small client asks for 20, a big one for 500.
        let mut leases = LeaseAllocator::new(LeaseRule::per_second(1_000)).unwrap();
        leases.request(1, 20, 0);
        leases.request(2, 500, 0);
        // Next windows' leases (asked in the last fifth of window 0): 20 and 80.
        assert_eq!(leases.request(1, 20, 85 * MS).permits, 20);
        assert_eq!(leases.request(2, 500, 85 * MS).permits, 80);
        // In window 1's last fifth the small one gives back 15 of its 20; the big one, short,
        // is topped up with them (its demand's rate over the 10 ms left: 51).
        let small = leases.request_returning(1, 20, 15, 190 * MS);
        assert_eq!(small.top_up, 0);
        let big = leases.request_returning(2, 500, 0, 190 * MS);
        assert_eq!(big.top_up, 15);
        assert_eq!(leases.granted(1), 100, "never past the window's budget");
        // A client cannot give back more than it was granted.
        let mut leases = LeaseAllocator::new(LeaseRule::per_second(1_000)).unwrap();
        leases.request(1, 20, 0);
        leases.request(1, 20, 85 * MS);
        leases.request_returning(1, 20, 1_000, 190 * MS);
        assert_eq!(leases.granted(1), 0);
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
