//! [`HotKeyHub`]: the hot-key engines of one server, sharded by key, with one broadcast
//! channel per app that carries event batches to the app's connected app servers.
//!
//! A report batch is split by shard; each shard's lock is taken once per batch. Events come out
//! of the engines and are published after the locks are released. Each app's channel holds at
//! most [`EVENT_BATCHES_BUFFERED_MAX`] batches; an app server that falls further behind gets a
//! fresh snapshot instead of the batches it missed, so a slow app server costs bounded memory.

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use levee_hotkey::{
    AppStats, EngineConfig, Event, HotEvent, HotKeyEngine, KeyCount, ReportError, Rule, RuleError,
    UnknownAppPolicy,
};
use levee_proto::WireError;
use levee_proto::v1::{ErrorCode, EventBatch, HotKeyEvent};
use tokio::sync::broadcast;

use super::clock::Clock;
use super::convert::{event_to_wire, hot_to_wire};
use crate::config::{Config, UnknownApp};
use crate::metrics::{AppLabels, Metrics, ReasonLabels};

/// Event batches buffered per app for its slowest app server.
pub const EVENT_BATCHES_BUFFERED_MAX: usize = 1_024;
/// Most apps with connected app servers at once (each holds a channel of
/// [`EVENT_BATCHES_BUFFERED_MAX`] slots).
pub const SUBSCRIBED_APPS_MAX: usize = 1_000;
/// Most keys a top-K request may ask for.
pub const TOP_KEYS_LIMIT_MAX: usize = 1_000;

/// The hot-key engines and their subscribers.
#[derive(Debug)]
pub struct HotKeyHub {
    shards: Box<[Mutex<HotKeyEngine>]>,
    hasher: foldhash::fast::FixedState,
    channels: RwLock<HashMap<String, Arc<AppChannel>>>,
    rules: Mutex<BTreeMap<String, Vec<Rule>>>,
    clock: Clock,
    batch_keys_max: usize,
    key_bytes_max: usize,
    unknown_app: UnknownApp,
    metrics: Metrics,
    budget_evictions_seen: AtomicU64,
}

/// One app's broadcast channel and subscriber count.
#[derive(Debug)]
pub struct AppChannel {
    sender: broadcast::Sender<Arc<EventBatch>>,
    clients: AtomicU64,
}

/// What a new subscriber starts from: the hot keys now, and the events after them.
#[derive(Debug)]
pub struct Subscription {
    /// The app's hot keys at subscription time.
    pub snapshot: Vec<HotKeyEvent>,
    /// Events after the snapshot (some may repeat it).
    pub receiver: broadcast::Receiver<Arc<EventBatch>>,
    /// Counts this subscriber while alive.
    pub guard: ClientGuard,
}

/// Counts one connected app server for as long as it lives.
#[derive(Debug)]
pub struct ClientGuard {
    channel: Arc<AppChannel>,
    metrics: Metrics,
    app: String,
}

impl Drop for ClientGuard {
    fn drop(&mut self) {
        self.channel.clients.fetch_sub(1, Ordering::Relaxed);
        self.metrics
            .hotkey_clients_connected
            .get_or_create(&AppLabels::new(&self.app))
            .dec();
    }
}

/// What one report batch did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Keys counted.
    pub accepted: u64,
    /// Keys refused (empty or too long).
    pub rejected: u64,
}

fn wire(code: ErrorCode, message: impl Into<String>) -> WireError {
    WireError::new(code, message)
}

fn rule_error(error: &RuleError) -> WireError {
    wire(ErrorCode::InvalidArgument, error.to_string())
}

impl HotKeyHub {
    /// Engines sized from `config`, one shard per core, with no rules yet: the replicated
    /// rules reach them through [`super::observer::HubObserver`] as the metadata log is
    /// applied.
    pub fn open(config: &Config, shard_count: usize) -> Self {
        let shard_count = shard_count.max(1);
        let budget_bytes = usize::try_from(config.hotkey_memory_budget_mb.saturating_mul(1 << 20))
            .unwrap_or(usize::MAX);
        let engine_config = EngineConfig {
            memory_budget_bytes: budget_bytes / shard_count,
            key_bytes_max: config.hotkey_key_bytes_max as usize,
            unknown_app: match config.hotkey_unknown_app {
                UnknownApp::Create => UnknownAppPolicy::Create,
                UnknownApp::Refuse => UnknownAppPolicy::Refuse,
            },
            ..EngineConfig::default()
        };
        let shards: Vec<_> = (0..shard_count)
            .map(|_| Mutex::new(HotKeyEngine::new(engine_config.clone())))
            .collect();
        Self {
            shards: shards.into_boxed_slice(),
            hasher: foldhash::fast::FixedState::with_seed(0x6c65_7665_6568_6b79),
            channels: RwLock::new(HashMap::new()),
            rules: Mutex::new(BTreeMap::new()),
            clock: Clock::new(),
            batch_keys_max: config.hotkey_batch_keys_max as usize,
            key_bytes_max: config.hotkey_key_bytes_max as usize,
            unknown_app: config.hotkey_unknown_app,
            metrics: Metrics::default(),
            budget_evictions_seen: AtomicU64::new(0),
        }
    }

    /// Records into `metrics` (the server's registry) from now on.
    #[must_use]
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        metrics
            .hotkey_memory_budget_bytes
            .set(i64::try_from(self.memory_budget_bytes()).unwrap_or(i64::MAX));
        self.metrics = metrics;
        self
    }

    fn memory_budget_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| lock(shard).memory().budget_bytes)
            .sum()
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        if self.shards.len() == 1 {
            return 0;
        }
        // The modulo of a 64-bit hash by a small shard count fits in usize.
        #[allow(clippy::cast_possible_truncation)]
        let shard = (self.hasher.hash_one(key) % self.shards.len() as u64) as usize;
        shard
    }

    /// Checks that a session may be opened for `app`.
    pub fn check_app(&self, app: &str) -> Result<(), WireError> {
        check_app_name(app)?;
        if self.unknown_app == UnknownApp::Refuse && !lock(&self.rules).contains_key(app) {
            return Err(wire(
                ErrorCode::NotFound,
                format!(
                    "unknown app '{app}'; set its rules first (this server refuses unknown apps: \
                     hotkey_unknown_app = refuse)"
                ),
            ));
        }
        Ok(())
    }

    /// The app's channel, created for its first subscriber while fewer than
    /// [`SUBSCRIBED_APPS_MAX`] apps have one.
    fn channel(&self, app: &str) -> Result<Arc<AppChannel>, WireError> {
        if let Some(channel) = read(&self.channels).get(app) {
            return Ok(Arc::clone(channel));
        }
        let mut channels = write(&self.channels);
        if channels.len() >= SUBSCRIBED_APPS_MAX && !channels.contains_key(app) {
            return Err(wire(
                ErrorCode::ResourceExhausted,
                format!(
                    "{SUBSCRIBED_APPS_MAX} apps already have app servers connected to this \
                     server; connect app '{app}' to another server"
                ),
            ));
        }
        Ok(Arc::clone(channels.entry(app.to_owned()).or_insert_with(
            || {
                Arc::new(AppChannel {
                    sender: broadcast::channel(EVENT_BATCHES_BUFFERED_MAX).0,
                    clients: AtomicU64::new(0),
                })
            },
        )))
    }

    /// Subscribes an app server to `app`: the snapshot of its hot keys, then its events.
    pub fn subscribe(&self, app: &str) -> Result<Subscription, WireError> {
        let channel = self.channel(app)?;
        // Subscribe before the snapshot, so that no event falls between the two.
        let receiver = channel.sender.subscribe();
        channel.clients.fetch_add(1, Ordering::Relaxed);
        self.metrics
            .hotkey_clients_connected
            .get_or_create(&AppLabels::new(app))
            .inc();
        Ok(Subscription {
            snapshot: self.snapshot(app),
            receiver,
            guard: ClientGuard {
                channel,
                metrics: self.metrics.clone(),
                app: app.to_owned(),
            },
        })
    }

    /// The app's hot keys now, on the wire.
    pub fn snapshot(&self, app: &str) -> Vec<HotKeyEvent> {
        let hot = self.hot_keys(app);
        // Read after the engines: every key was made hot at or before this time, so `hot_for`
        // never comes out longer than its duration.
        let now_ms = self.clock.now_ms();
        let rules = lock(&self.rules).get(app).cloned().unwrap_or_default();
        hot.iter()
            .map(|event| {
                let rule = rules.iter().find(|rule| rule.matcher == event.rule);
                hot_to_wire(event, rule, &self.clock, now_ms)
            })
            .collect()
    }

    /// Counts one report batch of `app`. Empty and too-long keys are skipped and counted; a
    /// batch above `hotkey_batch_keys_max` is refused whole.
    pub fn report(&self, app: &str, keys: &[(&[u8], u32)]) -> Result<BatchOutcome, WireError> {
        if keys.len() > self.batch_keys_max {
            self.reject("batch_too_large", 1);
            return Err(wire(
                ErrorCode::InvalidArgument,
                format!(
                    "report batch of {} keys is above the maximum {}; send smaller batches more \
                     often (or raise hotkey_batch_keys_max)",
                    keys.len(),
                    self.batch_keys_max
                ),
            ));
        }
        let now_ms = self.clock.now_ms();
        // Events are dated by the latest engine time: a shard whose clock another thread
        // (the ticker) moved past `now_ms` makes its events at that time, and `hot_for` must
        // not come out longer than the rule's duration.
        let mut publish_ms = now_ms;
        let mut outcome = BatchOutcome::default();
        let mut events = Vec::new();
        let mut by_shard: Vec<Vec<(&[u8], u32)>> = vec![Vec::new(); self.shards.len()];
        let mut hits = 0_u64;
        for &(key, count) in keys {
            // Checked here, so that the engine's batch never skips a key and every refusal is
            // counted by its reason.
            let reason = if key.is_empty() {
                "empty_key"
            } else if key.len() > self.key_bytes_max {
                "key_too_long"
            } else {
                let count = count.max(1);
                hits += u64::from(count);
                by_shard[self.shard_of(key)].push((key, count));
                continue;
            };
            outcome.rejected += 1;
            self.reject(reason, 1);
        }
        for (shard, items) in self.shards.iter().zip(&by_shard) {
            if items.is_empty() {
                continue;
            }
            let result = {
                let mut engine = lock(shard);
                let result = engine.report_batch(app, items, now_ms, &mut events);
                publish_ms = publish_ms.max(engine.now_ms());
                result
            };
            match result {
                Ok(counted) => outcome.accepted += counted.accepted as u64,
                Err(error) => {
                    self.reject(reject_reason(&error), items.len() as u64);
                    self.publish(&events, publish_ms);
                    return Err(report_error(&error));
                }
            }
        }
        let labels = AppLabels::new(app);
        self.metrics
            .hotkey_keys_received
            .get_or_create(&labels)
            .inc_by(outcome.accepted);
        self.metrics
            .hotkey_hits_received
            .get_or_create(&labels)
            .inc_by(hits);
        self.publish(&events, publish_ms);
        Ok(outcome)
    }

    fn reject(&self, reason: &'static str, count: u64) {
        self.metrics
            .hotkey_reports_rejected
            .get_or_create(&ReasonLabels { reason })
            .inc_by(count);
    }

    /// Expires hot keys and reclaims idle state; publishes cool events. Call every few ms.
    pub fn tick(&self) {
        let now_ms = self.clock.now_ms();
        // Dated by the latest engine time (see `report`).
        let mut publish_ms = now_ms;
        let mut events = Vec::new();
        let mut used_bytes = 0;
        let mut keys_tracked = 0;
        let mut budget_evictions = 0;
        for shard in &self.shards {
            let mut engine = lock(shard);
            engine.tick(now_ms, &mut events);
            publish_ms = publish_ms.max(engine.now_ms());
            let memory = engine.memory();
            used_bytes += memory.used_bytes;
            keys_tracked += memory.keys_tracked;
            budget_evictions += memory.budget_evictions;
        }
        self.publish(&events, now_ms);
        self.metrics
            .hotkey_memory_bytes
            .set(i64::try_from(used_bytes).unwrap_or(i64::MAX));
        self.metrics
            .hotkey_keys_tracked
            .set(i64::try_from(keys_tracked).unwrap_or(i64::MAX));
        let seen = self
            .budget_evictions_seen
            .swap(budget_evictions, Ordering::Relaxed);
        self.metrics
            .hotkey_budget_evictions
            .inc_by(budget_evictions.saturating_sub(seen));
    }

    fn publish(&self, events: &[Event], now_ms: u64) {
        if events.is_empty() {
            return;
        }
        let mut by_app: BTreeMap<&str, Vec<HotKeyEvent>> = BTreeMap::new();
        for event in events {
            let (app, kind) = match event {
                Event::Hot(hot) => {
                    if hot.source == levee_hotkey::HotSource::Detected && hot.count > 0 {
                        self.metrics
                            .hotkey_hot_detected
                            .get_or_create(&AppLabels::new(&hot.app))
                            .inc();
                    }
                    (hot.app.as_str(), "hot")
                }
                Event::Cool { app, .. } => (app.as_str(), "cool"),
            };
            self.metrics
                .hotkey_events_published
                .get_or_create(&ReasonLabels { reason: kind })
                .inc();
            by_app
                .entry(app)
                .or_default()
                .push(event_to_wire(event, &self.clock, now_ms));
        }
        let channels = read(&self.channels);
        for (app, events) in by_app {
            // An app without a channel, or without receivers, has nobody to tell.
            if let Some(channel) = channels.get(app) {
                let _ = channel.sender.send(Arc::new(EventBatch { events }));
            }
        }
    }

    /// Checks an app's rules as [`Self::set_rules`] would, changing nothing.
    pub fn check_rules(app: &str, rules: &[Rule]) -> Result<(), WireError> {
        check_app_name(app)?;
        for rule in rules {
            rule.validate().map_err(|error| rule_error(&error))?;
        }
        Ok(())
    }

    /// Replaces an app's rules on every shard (the replicated rules, as they are applied).
    pub fn set_rules(&self, app: &str, rules: Vec<Rule>) -> Result<(), WireError> {
        Self::check_rules(app, &rules)?;
        let mut saved = lock(&self.rules);
        // Every rule was validated above, so every shard accepts the set or none does.
        for shard in &self.shards {
            lock(shard)
                .set_rules(app, rules.clone())
                .map_err(|error| rule_error(&error))?;
        }
        saved.insert(app.to_owned(), rules);
        Ok(())
    }

    /// An app's rules: the saved ones, or the default rule of an app created by a report.
    pub fn rules(&self, app: &str) -> Result<Vec<Rule>, WireError> {
        if let Some(rules) = lock(&self.rules).get(app) {
            return Ok(rules.clone());
        }
        self.shards
            .iter()
            .find_map(|shard| lock(shard).rules(app))
            .ok_or_else(|| unknown(app))
    }

    /// The apps known to any shard, sorted.
    pub fn apps(&self) -> Vec<String> {
        let mut apps: Vec<String> = lock(&self.rules).keys().cloned().collect();
        for shard in &self.shards {
            apps.extend(lock(shard).apps());
        }
        apps.sort();
        apps.dedup();
        apps
    }

    /// Checks a manual hot key as [`Self::set_manual_hot`] would (app name, key length,
    /// duration), changing nothing.
    pub fn check_manual_hot(
        &self,
        app: &str,
        key: &[u8],
        duration_ms: u64,
    ) -> Result<(), WireError> {
        check_app_name(app)?;
        let refused = if key.is_empty() {
            Some(ReportError::EmptyKey {
                app: app.to_owned(),
                max: self.key_bytes_max,
            })
        } else if key.len() > self.key_bytes_max {
            Some(ReportError::KeyTooLong {
                app: app.to_owned(),
                length: key.len(),
                max: self.key_bytes_max,
            })
        } else if !(levee_hotkey::HOT_DURATION_MS_MIN..=levee_hotkey::HOT_DURATION_MS_MAX)
            .contains(&duration_ms)
        {
            Some(ReportError::InvalidDuration {
                app: app.to_owned(),
                got: duration_ms,
                min: levee_hotkey::HOT_DURATION_MS_MIN,
                max: levee_hotkey::HOT_DURATION_MS_MAX,
            })
        } else {
            None
        };
        refused.map_or(Ok(()), |error| Err(report_error(&error)))
    }

    /// The hot-key clock as Unix milliseconds (monotonic within this process).
    pub fn now_unix_ms(&self) -> u64 {
        self.clock.to_unix_ms(self.clock.now_ms())
    }

    /// Whether `key` of `app` is hot on this node now.
    pub fn is_hot(&self, app: &str, key: &[u8]) -> bool {
        self.hot_keys(app).iter().any(|hot| hot.key == key)
    }

    /// Sets `key` hot by hand until `expires_at_unix_ms`, if that is still ahead.
    pub fn set_manual_hot_until(
        &self,
        app: &str,
        key: &[u8],
        expires_at_unix_ms: u64,
    ) -> Result<(), WireError> {
        let remaining = expires_at_unix_ms.saturating_sub(self.now_unix_ms());
        if remaining < levee_hotkey::HOT_DURATION_MS_MIN {
            return Ok(());
        }
        self.set_manual_hot(app, key, remaining.min(levee_hotkey::HOT_DURATION_MS_MAX))
    }

    /// Sets `key` hot by hand for `duration_ms`, and pushes it.
    pub fn set_manual_hot(&self, app: &str, key: &[u8], duration_ms: u64) -> Result<(), WireError> {
        check_app_name(app)?;
        let now_ms = self.clock.now_ms();
        let mut events = Vec::new();
        let publish_ms = {
            let mut engine = lock(&self.shards[self.shard_of(key)]);
            engine
                .set_manual_hot(app, key, duration_ms, now_ms, &mut events)
                .map_err(|error| report_error(&error))?;
            engine.now_ms()
        };
        self.publish(&events, publish_ms);
        Ok(())
    }

    /// Cools `key` by hand and pushes the cool event. Returns whether it was hot.
    pub fn remove_hot(&self, app: &str, key: &[u8]) -> bool {
        let now_ms = self.clock.now_ms();
        let mut events = Vec::new();
        let (was_hot, publish_ms) = {
            let mut engine = lock(&self.shards[self.shard_of(key)]);
            let was_hot = engine.remove_hot(app, key, now_ms, &mut events);
            (was_hot, engine.now_ms())
        };
        self.publish(&events, publish_ms);
        was_hot
    }

    /// The app's hot keys now, from every shard.
    pub fn hot_keys(&self, app: &str) -> Vec<HotEvent> {
        let now_ms = self.clock.now_ms();
        let mut hot: Vec<HotEvent> = self
            .shards
            .iter()
            .flat_map(|shard| lock(shard).hot_keys(app, now_ms))
            .collect();
        hot.sort_by(|left, right| left.key.cmp(&right.key));
        hot
    }

    /// The app's `limit` keys with the highest window counts, from every shard.
    pub fn top_keys(&self, app: &str, limit: usize) -> Result<Vec<KeyCount>, WireError> {
        if limit == 0 || limit > TOP_KEYS_LIMIT_MAX {
            return Err(wire(
                ErrorCode::InvalidArgument,
                format!("limit must be 1 to {TOP_KEYS_LIMIT_MAX}, got {limit}"),
            ));
        }
        let now_ms = self.clock.now_ms();
        let mut keys: Vec<KeyCount> = self
            .shards
            .iter()
            .flat_map(|shard| lock(shard).top_k(app, limit, now_ms))
            .collect();
        keys.sort_by(|left, right| right.count.cmp(&left.count).then(left.key.cmp(&right.key)));
        keys.truncate(limit);
        Ok(keys)
    }

    /// The app's counters, summed over the shards, plus its connected app servers.
    pub fn stats(&self, app: &str) -> Result<(AppStats, u64), WireError> {
        let mut total: Option<AppStats> = None;
        for shard in &self.shards {
            if let Some(stats) = lock(shard).stats(app) {
                let sum = total.get_or_insert_with(AppStats::default);
                sum.hits_received += stats.hits_received;
                sum.reports_received += stats.reports_received;
                sum.hot_detected += stats.hot_detected;
                sum.hot_now += stats.hot_now;
                sum.keys_tracked += stats.keys_tracked;
            }
        }
        let clients = read(&self.channels)
            .get(app)
            .map_or(0, |channel| channel.clients.load(Ordering::Relaxed));
        total
            .map(|stats| (stats, clients))
            .ok_or_else(|| unknown(app))
    }
}

/// Checks an app name with the engine's one rule for it.
pub fn check_app_name(app: &str) -> Result<(), WireError> {
    levee_hotkey::validate_app_name(app).map_err(|error| rule_error(&error))
}

fn unknown(app: &str) -> WireError {
    wire(
        ErrorCode::NotFound,
        format!("unknown app '{app}'; set its rules or report keys first"),
    )
}

/// An engine's refusal as a wire error: one mapping for reports and manual hot keys alike.
fn report_error(error: &ReportError) -> WireError {
    let code = match error {
        ReportError::UnknownApp { .. } => ErrorCode::NotFound,
        ReportError::OverBudget { .. } => ErrorCode::ResourceExhausted,
        _ => ErrorCode::InvalidArgument,
    };
    wire(code, error.to_string())
}

fn reject_reason(error: &ReportError) -> &'static str {
    match error {
        ReportError::EmptyKey { .. } => "empty_key",
        ReportError::KeyTooLong { .. } => "key_too_long",
        ReportError::UnknownApp { .. } => "unknown_app",
        _ => "invalid_app",
    }
}

/// Locks a mutex; a panic elsewhere while holding it leaves counters, not invariants, so the
/// state is still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
