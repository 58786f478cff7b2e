//! Group rate limits: an operator caps a consumer group's delivery rate (for example one
//! business at 21,000,000 messages a minute). Every member's deliveries take tokens from the
//! group's [`Pacer`] before they go; they wait for tokens, nothing is dropped. The limit itself
//! is logged in the broker's catalog; this module enforces it and counts what it did.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use levee_broker::rate::TokenBucket;

use crate::metrics::{FloatGauge, GroupLabels, Metrics, SecondsCounter};
use crate::queue::lock;

/// One group's pacing: its token bucket (none without a limit) and metrics.
#[derive(Debug)]
pub struct Pacer {
    bucket: Mutex<Option<TokenBucket>>,
    delivered: prometheus_client::metrics::counter::Counter,
    throttled: SecondsCounter,
    limit: FloatGauge,
}

impl Pacer {
    /// Takes up to `wanted` tokens: how many, or how long until one is back.
    pub(crate) fn take(&self, wanted: u64) -> Result<u64, Duration> {
        match lock(&self.bucket).as_mut() {
            Some(bucket) => bucket.take(wanted, Instant::now()),
            None => Ok(wanted),
        }
    }

    /// Gives back tokens taken but not used.
    pub(crate) fn give_back(&self, count: u64) {
        if let Some(bucket) = lock(&self.bucket).as_mut() {
            bucket.give_back(count);
        }
    }

    /// Counts `messages` delivered.
    pub(crate) fn record_delivered(&self, messages: u64) {
        self.delivered.inc_by(messages);
    }

    /// Counts a wait of `wait` for tokens.
    pub(crate) fn record_throttled(&self, wait: Duration) {
        self.throttled.inc_by(wait.as_secs_f64());
    }

    /// Messages delivered to the group since start.
    pub fn delivered(&self) -> u64 {
        self.delivered.get()
    }

    /// Seconds the group's deliveries waited for tokens.
    pub fn throttled_s(&self) -> f64 {
        self.throttled.get()
    }
}

/// Every group's [`Pacer`].
#[derive(Debug)]
pub struct Pacers {
    pacers: Mutex<HashMap<String, Arc<Pacer>>>,
    metrics: Metrics,
}

impl Pacers {
    /// No pacers yet; they are made on first use.
    pub fn new(metrics: Metrics) -> Self {
        Self {
            pacers: Mutex::default(),
            metrics,
        }
    }

    /// The group's pacer, made at `rate_per_s` (0: unlimited) if new.
    pub fn get(&self, group: &str, rate_per_s: f64) -> Arc<Pacer> {
        let mut pacers = lock(&self.pacers);
        if let Some(pacer) = pacers.get(group) {
            return Arc::clone(pacer);
        }
        let labels = GroupLabels::new(group);
        let pacer = Arc::new(Pacer {
            bucket: Mutex::new(None),
            delivered: self
                .metrics
                .group_messages_delivered
                .get_or_create(&labels)
                .clone(),
            throttled: self
                .metrics
                .group_throttled_seconds
                .get_or_create(&labels)
                .clone(),
            limit: self
                .metrics
                .group_rate_limit_per_second
                .get_or_create(&labels)
                .clone(),
        });
        set_bucket(&pacer, rate_per_s);
        pacers.insert(group.to_owned(), Arc::clone(&pacer));
        pacer
    }

    /// Sets the group's rate (0: unlimited), at once.
    pub fn set(&self, group: &str, rate_per_s: f64) {
        let pacer = self.get(group, rate_per_s);
        set_bucket(&pacer, rate_per_s);
    }
}

fn set_bucket(pacer: &Pacer, rate_per_s: f64) {
    TokenBucket::apply(&mut lock(&pacer.bucket), rate_per_s, Instant::now());
    pacer.limit.set(rate_per_s);
}
