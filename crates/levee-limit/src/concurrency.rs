//! [`ConcurrencyLimiter`]: at most `limit` calls in flight. A call takes a slot with
//! [`ConcurrencyLimiter::try_acquire`] and gives it back with [`ConcurrencyLimiter::release`];
//! the limit may change at any time (an adaptive limit moves it), and calls in flight above a
//! lowered limit finish normally while new ones wait for the count to fall below it.

/// Calls in flight, against a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConcurrencyLimiter {
    limit: u64,
    in_flight: u64,
}

impl ConcurrencyLimiter {
    /// A limiter of `limit` calls in flight (0 admits nothing).
    pub fn new(limit: u64) -> Self {
        Self {
            limit,
            in_flight: 0,
        }
    }

    /// Takes a slot if one is free.
    pub fn try_acquire(&mut self) -> bool {
        if self.in_flight < self.limit {
            self.in_flight += 1;
            true
        } else {
            false
        }
    }

    /// Gives a slot back (a release without an acquire is ignored).
    pub fn release(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Sets the limit.
    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Calls in flight now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_a_limit_then_calls_beyond_it_wait_for_a_release_and_a_lower_limit_drains() {
        let mut limiter = ConcurrencyLimiter::new(2);
        assert!(limiter.try_acquire() && limiter.try_acquire());
        assert!(!limiter.try_acquire());
        limiter.release();
        assert!(limiter.try_acquire());
        limiter.set_limit(1);
        limiter.release();
        assert!(
            !limiter.try_acquire(),
            "one still in flight at a limit of one"
        );
        limiter.release();
        assert!(limiter.try_acquire());
        assert_eq!(limiter.in_flight(), 1);
    }
}
