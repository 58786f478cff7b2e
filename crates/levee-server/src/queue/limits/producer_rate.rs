//! Producer rate limits: an operator limits the append rate of every request that names a
//! `producer_name` (on `Queues.Append` and `Topics.Publish` alike; many processes may share
//! one name). A request reserves its message count from the name's [`TokenBucket`] and the
//! server holds it until the reservation is due, so requests go in the order they arrived and
//! never ahead of the rate; nothing is dropped. A request that would wait longer than
//! [`WAIT_MAX`] is refused at once (`RESOURCE_EXHAUSTED`, nothing stored, nothing reserved), so
//! a producer far over its limit cannot pile held requests up on the server. Requests without a
//! name, or naming one without a limit, are not paced.
//!
//! Only names with a limit have state and metrics (at most [`PRODUCER_RATES_MAX`] at once);
//! a cleared name keeps its figures until the slot is needed for another.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use levee_proto::WireError;
use levee_proto::v1::ErrorCode;
use prometheus_client::metrics::counter::Counter;

use levee_broker::catalog::PRODUCER_RATES_MAX;
use levee_broker::names::check_producer_name;
use levee_broker::rate::TokenBucket;

use crate::metrics::{FloatGauge, Metrics, ProducerLabels, SecondsCounter};
use crate::queue::{lock, name_error};

/// The time on tokio's clock (virtual in tests with paused time), as the buckets take it.
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Longest a request is held for its producer's rate limit; one that would wait longer is
/// refused.
pub const WAIT_MAX: Duration = Duration::from_secs(10);

/// One producer name's limit (none once cleared) and figures.
#[derive(Debug)]
struct ProducerLimit {
    bucket: Mutex<Option<TokenBucket>>,
    admitted: Counter,
    throttled: SecondsCounter,
    limit: FloatGauge,
}

/// A request's reservation under its producer's limit (none for an unlimited request). Dropped
/// without [`Admission::stored`] (the client went away while it was held, or the append
/// failed), it gives its tokens back, so later requests are not held for messages never stored.
#[derive(Debug)]
#[must_use = "call stored() once the messages are stored; dropping gives the tokens back"]
pub struct Admission {
    limit: Option<Arc<ProducerLimit>>,
    messages: u64,
}

impl Admission {
    /// The messages were stored: they count as admitted.
    pub fn stored(mut self) {
        if let Some(limit) = self.limit.take() {
            limit.admitted.inc_by(self.messages);
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if let Some(limit) = &self.limit
            && let Some(bucket) = lock(&limit.bucket).as_mut()
        {
            bucket.give_back(self.messages);
        }
    }
}

/// A producer name's limit and figures, as `DescribeProducer` answers.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ProducerFigures {
    /// Messages per second, 0 for none.
    pub rate_limit_per_s: f64,
    /// Messages admitted under a limit since the server started.
    pub admitted: u64,
    /// Seconds its requests waited.
    pub throttled_s: f64,
}

/// Every limited producer name's pacing.
#[derive(Debug)]
pub struct ProducerRates {
    limits: RwLock<HashMap<String, Arc<ProducerLimit>>>,
    metrics: Metrics,
}

impl ProducerRates {
    /// The limits `rates` (loaded from the metadata queue).
    pub fn new(metrics: Metrics, rates: &BTreeMap<String, f64>) -> Self {
        let producer_rates = Self {
            limits: RwLock::default(),
            metrics,
        };
        for (name, &rate) in rates {
            producer_rates.set(name, rate);
        }
        producer_rates
    }

    fn find(&self, producer_name: &str) -> Option<Arc<ProducerLimit>> {
        self.limits
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(producer_name)
            .cloned()
    }

    /// Applies `producer_name`'s limit at once (0 clears it). The durable record is written
    /// first, by [`crate::queue::topic::catalog::Topics::set_producer_rate`], which also bounds how many names
    /// have a limit.
    pub fn set(&self, producer_name: &str, rate_per_s: f64) {
        let mut limits = self
            .limits
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !limits.contains_key(producer_name) {
            if rate_per_s <= 0.0 {
                return;
            }
            if limits.len() >= PRODUCER_RATES_MAX {
                self.forget_one_cleared(&mut limits);
            }
            let labels = ProducerLabels::new(producer_name);
            let limit = ProducerLimit {
                bucket: Mutex::new(None),
                admitted: self
                    .metrics
                    .producer_messages_admitted
                    .get_or_create(&labels)
                    .clone(),
                throttled: self
                    .metrics
                    .producer_throttled_seconds
                    .get_or_create(&labels)
                    .clone(),
                limit: self
                    .metrics
                    .producer_rate_limit_per_second
                    .get_or_create(&labels)
                    .clone(),
            };
            limits.insert(producer_name.to_owned(), Arc::new(limit));
        }
        let limit = &limits[producer_name];
        TokenBucket::apply(&mut lock(&limit.bucket), rate_per_s, now());
        limit.limit.set(rate_per_s.max(0.0));
    }

    /// Drops the state and metrics of one cleared name, to make room for a new one (the
    /// metadata bounds the limited names, so one is cleared when the map is full).
    fn forget_one_cleared(&self, limits: &mut HashMap<String, Arc<ProducerLimit>>) {
        let cleared = limits
            .iter()
            .find(|(_, limit)| lock(&limit.bucket).is_none())
            .map(|(name, _)| name.clone());
        if let Some(name) = cleared {
            limits.remove(&name);
            let labels = ProducerLabels::new(&name);
            self.metrics.producer_messages_admitted.remove(&labels);
            self.metrics.producer_throttled_seconds.remove(&labels);
            self.metrics.producer_rate_limit_per_second.remove(&labels);
        }
    }

    /// `producer_name`'s limit and figures (zeros for a name never limited).
    pub fn figures(&self, producer_name: &str) -> ProducerFigures {
        self.find(producer_name)
            .map(|limit| ProducerFigures {
                rate_limit_per_s: lock(&limit.bucket)
                    .as_ref()
                    .map_or(0.0, TokenBucket::rate_per_s),
                admitted: limit.admitted.get(),
                throttled_s: limit.throttled.get(),
            })
            .unwrap_or_default()
    }

    /// Holds a request of `messages` messages naming `producer_name` (empty: none) until its
    /// limit admits them; refuses it when that would take over [`WAIT_MAX`], or when the name
    /// is too long. Call [`Admission::stored`] once the messages are stored: a request dropped
    /// before (its client went away while held, or the append failed) gives its tokens back.
    pub async fn admit(&self, producer_name: &str, messages: u64) -> Result<Admission, WireError> {
        let unlimited = Admission {
            limit: None,
            messages,
        };
        if producer_name.is_empty() {
            return Ok(unlimited);
        }
        check_producer_name(producer_name).map_err(|error| name_error(&error))?;
        let Some(limit) = self.find(producer_name) else {
            return Ok(unlimited);
        };
        let reserved = match lock(&limit.bucket).as_mut() {
            None => return Ok(unlimited),
            Some(bucket) => bucket
                .reserve(messages, now(), WAIT_MAX)
                .map_err(|wait| (wait, bucket.rate_per_s())),
        };
        match reserved {
            Ok(wait) => {
                let admission = Admission {
                    limit: Some(Arc::clone(&limit)),
                    messages,
                };
                if !wait.is_zero() {
                    tokio::time::sleep(wait).await;
                    limit.throttled.inc_by(wait.as_secs_f64());
                }
                Ok(admission)
            }
            Err((wait, rate)) => Err(WireError::new(
                ErrorCode::ResourceExhausted,
                format!(
                    "producer '{producer_name}' is limited to {rate} messages/s: these \
                     {messages} messages would wait {:.1} s for it, over the {} s the server \
                     holds a request; nothing was stored. Send fewer messages at once, or \
                     raise the limit (levee producer set-rate)",
                    wait.as_secs_f64(),
                    WAIT_MAX.as_secs()
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rates() -> ProducerRates {
        ProducerRates::new(Metrics::new(), &BTreeMap::new())
    }

    #[tokio::test(start_paused = true)]
    async fn given_limit_then_requests_are_held_in_turn_and_counted() {
        let rates = rates();
        rates.set("checkout", 1_000.0);
        let start = tokio::time::Instant::now();
        rates.admit("checkout", 10).await.unwrap().stored();
        rates.admit("checkout", 500).await.unwrap().stored();
        rates.admit("checkout", 500).await.unwrap().stored();
        let held = start.elapsed().as_secs_f64();
        assert!(
            (0.99..1.01).contains(&held),
            "held {held} s for 1,000 messages"
        );
        // Another name and no name are not paced.
        rates.admit("other", 1_000_000).await.unwrap().stored();
        rates.admit("", 1_000_000).await.unwrap().stored();
        assert!(start.elapsed().as_secs_f64() < 1.01);
        let figures = rates.figures("checkout");
        assert_eq!(figures.admitted, 1_010);
        assert!((figures.rate_limit_per_s - 1_000.0).abs() < 1e-9);
        assert!((figures.throttled_s - 1.0).abs() < 0.01, "{figures:?}");
        assert_eq!(rates.figures("other"), ProducerFigures::default());
    }

    #[tokio::test(start_paused = true)]
    async fn given_request_over_the_wait_limit_then_refused_at_once_and_nothing_reserved() {
        let rates = rates();
        rates.set("slow", 10.0);
        let start = tokio::time::Instant::now();
        let error = rates.admit("slow", 500).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::ResourceExhausted);
        assert!(
            error.message.contains("limited to 10 messages/s"),
            "{error}"
        );
        assert!(start.elapsed().is_zero());
        // The refused request reserved nothing: a small one goes at once.
        rates.admit("slow", 1).await.unwrap().stored();
        assert!(start.elapsed().is_zero());
        let error = rates.admit(&"x".repeat(65), 1).await.unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidArgument);
    }

    #[tokio::test(start_paused = true)]
    async fn given_held_request_dropped_then_its_tokens_are_given_back() {
        let rates = rates();
        rates.set("checkout", 100.0);
        rates.admit("checkout", 1).await.unwrap().stored();
        // Reserves 500 (a 5 s wait), then its client goes away after 1 s.
        let held = tokio::time::timeout(Duration::from_secs(1), rates.admit("checkout", 500));
        assert!(held.await.is_err(), "still held after 1 s");
        // Without the give-back this one would wait out the dropped request's 4 s left.
        let start = tokio::time::Instant::now();
        rates.admit("checkout", 50).await.unwrap().stored();
        let waited = start.elapsed().as_secs_f64();
        assert!(waited < 0.6, "waited {waited} s");
        // Admitted but not stored (the append failed): the tokens come back too.
        let failed = rates.admit("checkout", 300).await.unwrap();
        drop(failed);
        let start = tokio::time::Instant::now();
        rates.admit("checkout", 50).await.unwrap().stored();
        let waited = start.elapsed().as_secs_f64();
        assert!(waited < 0.6, "waited {waited} s after a failed append");
        assert_eq!(rates.figures("checkout").admitted, 101);
    }

    #[tokio::test(start_paused = true)]
    async fn given_limit_cleared_then_not_paced_and_figures_kept() {
        let rates = rates();
        rates.set("batch", 100.0);
        rates.admit("batch", 1).await.unwrap().stored();
        rates.set("batch", 0.0);
        let start = tokio::time::Instant::now();
        rates.admit("batch", 100_000).await.unwrap().stored();
        assert!(start.elapsed().is_zero());
        let figures = rates.figures("batch");
        assert_eq!(figures.admitted, 1);
        assert!(figures.rate_limit_per_s.abs() < f64::EPSILON);
    }
}
