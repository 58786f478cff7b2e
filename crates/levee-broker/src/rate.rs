//! [`TokenBucket`]: paces a consumer group's deliveries (and a producer's appends) to its
//! configured rate. The bucket
//! holds at most [`BURST`] worth of tokens (10 ms of the rate, at least one message), so over
//! any interval T the group gets at most rate x T + burst messages: at 1,000 messages/s over
//! 10 s that is 10,010, within 0.1%. Deliveries wait for tokens; nothing is dropped. The time
//! is an argument, so the bucket is tested without sleeping.

use std::time::{Duration, Instant};

/// The bucket's depth, as time at the configured rate.
pub const BURST: Duration = Duration::from_millis(10);
/// The lowest limit accepted: one message an hour (a lower one would make waits that no
/// `Duration` holds).
pub const RATE_MIN_PER_S: f64 = 1.0 / 3600.0;

/// A token bucket in messages.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate_per_s: f64,
    tokens: f64,
    updated: Instant,
}

impl TokenBucket {
    /// A full bucket at `rate_per_s` (> 0).
    pub fn new(rate_per_s: f64, now: Instant) -> Self {
        let mut bucket = Self {
            rate_per_s,
            tokens: 0.0,
            updated: now,
        };
        bucket.tokens = bucket.depth();
        bucket
    }

    fn depth(&self) -> f64 {
        (self.rate_per_s * BURST.as_secs_f64()).max(1.0)
    }

    /// Sets the limit of an optional bucket: a new full bucket, a changed rate (see
    /// [`TokenBucket::set_rate`]), or none for a rate of 0.
    pub fn apply(bucket: &mut Option<Self>, rate_per_s: f64, now: Instant) {
        match (bucket.as_mut(), rate_per_s > 0.0) {
            (Some(existing), true) => existing.set_rate(rate_per_s, now),
            (None, true) => *bucket = Some(Self::new(rate_per_s, now)),
            (_, false) => *bucket = None,
        }
    }

    /// The configured rate.
    pub fn rate_per_s(&self) -> f64 {
        self.rate_per_s
    }

    /// Changes the rate, keeping the tokens already earned (up to the new depth). A debt
    /// (requests held for their reservations) is rescaled so that it is paid off when it would
    /// have been: requests reserving next queue behind the held ones, not far behind or ahead.
    pub fn set_rate(&mut self, rate_per_s: f64, now: Instant) {
        self.refill(now);
        if self.tokens < 0.0 {
            self.tokens *= rate_per_s / self.rate_per_s;
        }
        self.rate_per_s = rate_per_s;
        self.tokens = self.tokens.min(self.depth());
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.updated).as_secs_f64();
        self.tokens = (self.tokens + elapsed * self.rate_per_s).min(self.depth());
        self.updated = now;
    }

    /// Takes up to `wanted` whole tokens. `Ok(n)` with n >= 1 when some were available, else
    /// `Err(wait)`: how long until one is.
    pub fn take(&mut self, wanted: u64, now: Instant) -> Result<u64, Duration> {
        self.refill(now);
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss,
            reason = "tokens are a small non-negative count"
        )]
        let granted = (self.tokens.floor() as u64).min(wanted);
        if granted == 0 {
            let missing = 1.0 - self.tokens;
            return Err(Duration::from_secs_f64(missing / self.rate_per_s));
        }
        #[allow(clippy::cast_precision_loss, reason = "a small count")]
        let spent = granted as f64;
        self.tokens -= spent;
        Ok(granted)
    }

    /// Reserves `count` tokens for a request that then waits its turn: the bucket may go into
    /// debt, and the answer is how long the request waits before it goes (zero when the tokens
    /// were there), so requests go in the order they reserved and never ahead of the rate.
    /// `Err(wait)` when that wait would be over `wait_max`: nothing is reserved then.
    pub fn reserve(
        &mut self,
        count: u64,
        now: Instant,
        wait_max: Duration,
    ) -> Result<Duration, Duration> {
        self.refill(now);
        #[allow(clippy::cast_precision_loss, reason = "a request's message count")]
        let after = self.tokens - count as f64;
        let wait_s = if after >= 0.0 {
            0.0
        } else {
            -after / self.rate_per_s
        };
        if wait_s > wait_max.as_secs_f64() {
            return Err(Duration::try_from_secs_f64(wait_s).unwrap_or(Duration::MAX));
        }
        let wait = Duration::from_secs_f64(wait_s);
        self.tokens = after;
        Ok(wait)
    }

    /// Gives back `count` tokens taken but not used (a read found fewer messages).
    pub fn give_back(&mut self, count: u64) {
        #[allow(clippy::cast_precision_loss, reason = "a small count")]
        let count = count as f64;
        self.tokens = (self.tokens + count).min(self.depth());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_greedy_taker_then_grants_follow_the_rate_within_the_burst() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(1_000.0, start);
        let mut granted = 0;
        let mut now = start;
        let end = start + Duration::from_secs(10);
        while now < end {
            match bucket.take(64, now) {
                Ok(count) => granted += count,
                Err(wait) => now += wait.max(Duration::from_micros(1)),
            }
        }
        // 10,000 earned plus the first full bucket of 10.
        assert!((9_990..=10_011).contains(&granted), "{granted}");
    }

    #[test]
    fn given_empty_bucket_then_wait_says_when_one_token_is_back() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(2.0, start);
        assert_eq!(bucket.take(5, start), Ok(1));
        let wait = bucket.take(1, start).unwrap_err();
        assert!((wait.as_secs_f64() - 0.5).abs() < 1e-6, "{wait:?}");
        assert_eq!(bucket.take(1, start + wait), Ok(1));
        bucket.give_back(1);
        assert_eq!(bucket.take(3, start + wait), Ok(1), "capped at the depth");
    }

    #[test]
    fn given_reservations_then_each_goes_when_the_rate_allows_and_never_ahead_of_it() {
        let start = Instant::now();
        let wait_max = Duration::from_secs(10);
        let mut bucket = TokenBucket::new(1_000.0, start);
        // The first 10 go at once (the bucket's depth), the next 100 wait 0.1 s, then 0.2 s.
        assert_eq!(bucket.reserve(10, start, wait_max), Ok(Duration::ZERO));
        let first = bucket.reserve(100, start, wait_max).unwrap();
        assert!((first.as_secs_f64() - 0.1).abs() < 1e-9, "{first:?}");
        let second = bucket.reserve(100, start, wait_max).unwrap();
        assert!((second.as_secs_f64() - 0.2).abs() < 1e-9, "{second:?}");
        // Over the limit: refused, nothing reserved.
        let refused = bucket.reserve(20_000, start, wait_max).unwrap_err();
        assert!(refused > wait_max, "{refused:?}");
        let third = bucket.reserve(100, start, wait_max).unwrap();
        assert!((third.as_secs_f64() - 0.3).abs() < 1e-9, "{third:?}");
    }

    #[test]
    fn given_greedy_reserver_then_admitted_follow_the_rate_within_the_burst() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(1_000.0, start);
        let end = start + Duration::from_secs(10);
        let (mut admitted, mut now) = (0, start);
        // Requests of 64 one after another, each sent when the previous one was admitted.
        loop {
            let wait = bucket.reserve(64, now, Duration::from_secs(10)).unwrap();
            now += wait;
            if now > end {
                break;
            }
            admitted += 64;
        }
        // 10,000 earned plus the first full bucket of 10, in whole requests.
        assert!((9_936..=10_010).contains(&admitted), "{admitted}");
    }

    #[test]
    fn given_debt_when_rate_changes_then_it_is_paid_off_when_it_would_have_been() {
        let start = Instant::now();
        let wait_max = Duration::from_secs(60);
        let mut bucket = TokenBucket::new(100_000.0, start);
        // 4,010 reserved at 100,000/s, 1,000 from the full bucket: the last held request goes
        // after 30.1 ms.
        bucket.reserve(10, start, wait_max).unwrap();
        bucket.reserve(4_000, start, wait_max).unwrap();
        // Lowered to 100/s: the next request queues behind the held ones (30.1 ms), then waits
        // for its own 10 messages at the new rate (100 ms): not 30 s.
        bucket.set_rate(100.0, start);
        let next = bucket.reserve(10, start, wait_max).unwrap();
        assert!((next.as_secs_f64() - 0.1301).abs() < 1e-6, "{next:?}");
        // A tiny rate refuses with a wait instead of overflowing.
        let mut slow = TokenBucket::new(RATE_MIN_PER_S, start);
        assert!(slow.reserve(10_000, start, wait_max).is_err());
    }

    #[test]
    fn given_rate_change_then_new_rate_applies_at_once() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(100.0, start);
        bucket.take(1, start).unwrap();
        bucket.set_rate(100_000.0, start);
        let later = start + Duration::from_millis(10);
        assert_eq!(bucket.take(5_000, later), Ok(1_000));
    }
}
