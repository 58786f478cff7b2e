//! [`HotKeys`]: the app-server side of hot-key detection.
//!
//! `is_hot(key)` records one access in a local, pre-aggregated buffer and answers from the local
//! set of hot keys; it never waits on the network and never fails (trouble goes to logs and
//! [`HotKeysStats`]). Every `report_interval` a background task sends the buffer to the
//! servers, each key to one server chosen by rendezvous hashing over the servers connected at
//! that moment, so adding or removing a server moves only that server's share of the keys. Each
//! server keeps one long-lived session per app server and pushes hot and cool events on it; a
//! session that breaks is reopened with exponential backoff, and the server's first message on a
//! new session is a snapshot of the app's hot keys.

use std::collections::HashMap;
use std::future::Future;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use levee_proto::v1::hot_key_client_message::Kind as ClientKind;
use levee_proto::v1::hot_key_server_message::Kind as ServerKind;
use levee_proto::v1::hot_keys_client::HotKeysClient;
use levee_proto::v1::{
    Hello, HotKeyClientMessage, HotKeyEvent, HotKeySource, KeyReport, ReportBatch,
};
use tokio::sync::{OnceCell, mpsc, watch};
use tonic::transport::Endpoint;

use crate::error::ClientError;

/// Shortest allowed report interval.
pub const REPORT_INTERVAL_MIN: Duration = Duration::from_millis(1);
/// Longest allowed report interval.
pub const REPORT_INTERVAL_MAX: Duration = Duration::from_millis(500);
/// Report batches queued per server while its session is busy; more are dropped and counted.
const BATCHES_QUEUED_PER_SERVER_MAX: usize = 64;
/// Default payload bytes of one report message: the gRPC library's default message limit,
/// which every server takes whatever its key and batch limits.
pub const REPORT_BATCH_BYTES_MAX_DEFAULT: usize = 4 << 20;
/// The smallest `batch_bytes_max`: one key of the largest size a server may allow (64 KiB)
/// fits, with its framing.
pub const REPORT_BATCH_BYTES_MIN: usize =
    (64 << 10) + levee_proto::REPORT_KEY_OVERHEAD_BYTES + levee_proto::REPORT_BATCH_OVERHEAD_BYTES;
/// Buffer shards, so that app threads recording at once rarely wait on each other.
const BUFFER_SHARDS: usize = 16;

/// How a [`HotKeys`] reports and reconnects.
#[derive(Debug, Clone)]
pub struct HotKeysOptions {
    /// The app (namespace): 1 to 128 of `[A-Za-z0-9._-]`.
    pub app: String,
    /// The servers' gRPC addresses (`HOST:PORT`); keys are spread over them.
    pub servers: Vec<String>,
    /// Names this app server in the servers' logs.
    pub client_id: String,
    /// How often recorded accesses are sent, 1 to 500 ms (default 100 ms).
    pub report_interval: Duration,
    /// Distinct keys buffered between two reports; accesses to further keys are dropped and
    /// counted (default 100000).
    pub buffer_keys_max: usize,
    /// Keys per report message, at most the server's `hotkey_batch_keys_max` (default 10000).
    pub batch_keys_max: usize,
    /// Bytes per report message, keys and their framing counted (default 4 MiB, which every
    /// server takes); a round of reports is split by keys and by bytes, whichever comes first.
    pub batch_bytes_max: usize,
    /// First wait before reconnecting (default 100 ms); doubles up to `reconnect_backoff_max`.
    pub reconnect_backoff_min: Duration,
    /// Longest wait before reconnecting (default 5 s).
    pub reconnect_backoff_max: Duration,
    /// Most time to establish a connection (default 5 s).
    pub connect_timeout: Duration,
    /// Follow the cluster (default true): `servers` are seeds; the client asks one of them for
    /// the cluster's members (the `Cluster.WatchMembers` stream), holds a session with every
    /// member and routes keys over the members, following every change. False: exactly
    /// `servers`, as given.
    pub follow_cluster: bool,
}

impl HotKeysOptions {
    /// Options for `app` against `servers`, with defaults for the rest.
    pub fn new(app: impl Into<String>, servers: Vec<String>) -> Self {
        Self {
            app: app.into(),
            servers,
            client_id: format!("pid-{}", std::process::id()),
            report_interval: Duration::from_millis(100),
            buffer_keys_max: 100_000,
            batch_keys_max: 10_000,
            batch_bytes_max: REPORT_BATCH_BYTES_MAX_DEFAULT,
            reconnect_backoff_min: Duration::from_millis(100),
            reconnect_backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            follow_cluster: true,
        }
    }

    fn validate(&self) -> Result<(), ClientError> {
        let invalid = |message: String| Err(ClientError::InvalidOptions(message));
        if self.servers.is_empty() {
            return invalid("servers: give at least one server address".to_owned());
        }
        if !(REPORT_INTERVAL_MIN..=REPORT_INTERVAL_MAX).contains(&self.report_interval) {
            return invalid(format!(
                "report_interval must be 1 to 500 ms, got {} ms",
                self.report_interval.as_millis()
            ));
        }
        if self.buffer_keys_max == 0 || self.batch_keys_max == 0 {
            return invalid("buffer_keys_max and batch_keys_max must be at least 1".to_owned());
        }
        if self.batch_bytes_max < REPORT_BATCH_BYTES_MIN {
            return invalid(format!(
                "batch_bytes_max must be at least {REPORT_BATCH_BYTES_MIN} (a key of the largest \
                 size fits, with its framing), got {}",
                self.batch_bytes_max
            ));
        }
        if self.reconnect_backoff_min.is_zero()
            || self.reconnect_backoff_min > self.reconnect_backoff_max
        {
            return invalid(
                "reconnect_backoff_min must be above 0 and at most reconnect_backoff_max"
                    .to_owned(),
            );
        }
        Ok(())
    }
}

/// A key that turned hot or cooled, as callbacks see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotKeyChange {
    /// The key.
    pub key: Vec<u8>,
    /// True when it turned hot (or its hot period was extended), false when it cooled.
    pub hot: bool,
    /// How long it stays hot from now (0 when it cooled).
    pub hot_for: Duration,
    /// Whether an operator set it by hand.
    pub manual: bool,
}

/// Counters of one [`HotKeys`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HotKeysStats {
    /// Accesses recorded.
    pub accesses_recorded: u64,
    /// Accesses dropped because the buffer held `buffer_keys_max` distinct keys.
    pub accesses_dropped: u64,
    /// Keys sent in reports.
    pub keys_reported: u64,
    /// Keys dropped because no server was connected or a server's queue was full.
    pub keys_unsent: u64,
    /// Report messages dropped because their server's queue was full (their keys are counted
    /// in `keys_unsent` too).
    pub batches_unsent: u64,
    /// Hot and cool events (snapshot entries included) received.
    pub events_received: u64,
    /// Sessions opened, first ones included.
    pub sessions_opened: u64,
    /// Servers connected now.
    pub servers_connected: u64,
}

type Callback = Box<dyn Fn(&HotKeyChange) + Send + Sync>;
/// Accesses recorded since the last report, pre-aggregated by key.
type ReportBuffer = Mutex<HashMap<Box<[u8]>, u32>>;
/// Loads in flight, one per key.
type Loads<V> = Mutex<HashMap<Box<[u8]>, Arc<OnceCell<V>>>>;

/// The local record of a hot key.
#[derive(Debug)]
struct LocalHot<V> {
    until: Instant,
    server: usize,
    value: Option<V>,
}

/// One server's session slot. Links are never removed (their index is the server's number for
/// good); a server that leaves the cluster is retired, and taken up again if it comes back.
#[derive(Debug)]
struct ServerLink {
    address: String,
    seed: u64,
    sender: Mutex<Option<mpsc::Sender<HotKeyClientMessage>>>,
    /// True while the server is one the client routes to; its session task runs meanwhile.
    active: watch::Sender<bool>,
}

impl ServerLink {
    fn new(address: &str, hasher: foldhash::fast::FixedState) -> Self {
        Self {
            address: address.to_owned(),
            seed: hasher.hash_one(address.as_bytes()),
            sender: Mutex::new(None),
            active: watch::Sender::new(true),
        }
    }

    fn is_active(&self) -> bool {
        *self.active.borrow()
    }
}

/// Most servers a client holds links to over its life (members seen, seeds included).
pub const SERVERS_MAX: usize = 256;

#[derive(Debug, Default)]
struct Counters {
    accesses_recorded: AtomicU64,
    accesses_dropped: AtomicU64,
    keys_reported: AtomicU64,
    keys_unsent: AtomicU64,
    batches_unsent: AtomicU64,
    events_received: AtomicU64,
    sessions_opened: AtomicU64,
}

struct Inner<V> {
    options: HotKeysOptions,
    hasher: foldhash::fast::FixedState,
    buffer: Box<[ReportBuffer]>,
    buffered_keys: AtomicUsize,
    hot: RwLock<HashMap<Box<[u8]>, LocalHot<V>>>,
    loads: Loads<V>,
    callbacks: RwLock<Vec<Callback>>,
    links: RwLock<Vec<Arc<ServerLink>>>,
    /// Where background tasks run, and what stops them.
    runtime: tokio::runtime::Handle,
    stopped: watch::Receiver<bool>,
    counters: Counters,
    stopping: AtomicBool,
}

impl<V> std::fmt::Debug for Inner<V> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("HotKeys")
            .field("app", &self.options.app)
            .finish_non_exhaustive()
    }
}

/// Stops the background tasks when the last [`HotKeys`] handle is dropped.
#[derive(Debug)]
struct StopOnDrop(watch::Sender<bool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(true);
    }
}

/// The hot-key client of one app on one app server. Cheap to clone; clones share everything.
/// `V` is the type of locally cached values.
#[derive(Debug)]
pub struct HotKeys<V = Vec<u8>> {
    inner: Arc<Inner<V>>,
    stop: Arc<StopOnDrop>,
}

impl<V> Clone for HotKeys<V> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            stop: Arc::clone(&self.stop),
        }
    }
}

impl<V: Clone + Send + Sync + 'static> HotKeys<V> {
    /// Starts reporting and listening in the background on the current tokio runtime. Returns
    /// at once; sessions open in the background (check [`HotKeys::stats`]).
    pub fn start(options: HotKeysOptions) -> Result<Self, ClientError> {
        options.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ClientError::InvalidOptions("HotKeys::start must run inside a tokio runtime".to_owned())
        })?;
        let hasher = foldhash::fast::FixedState::with_seed(0x686f_746b_6579_7321);
        let links = options
            .servers
            .iter()
            .map(|address| Arc::new(ServerLink::new(address, hasher)))
            .collect();
        let (stop, stopped) = watch::channel(false);
        let inner = Arc::new(Inner {
            hasher,
            buffer: (0..BUFFER_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            buffered_keys: AtomicUsize::new(0),
            hot: RwLock::new(HashMap::new()),
            loads: Mutex::new(HashMap::new()),
            callbacks: RwLock::new(Vec::new()),
            links: RwLock::new(links),
            runtime: runtime.clone(),
            stopped: stopped.clone(),
            counters: Counters::default(),
            stopping: AtomicBool::new(false),
            options,
        });
        for index in 0..read(&inner.links).len() {
            runtime.spawn(run_link(Arc::clone(&inner), index, stopped.clone()));
        }
        if inner.options.follow_cluster {
            runtime.spawn(run_membership(Arc::clone(&inner), stopped.clone()));
        }
        runtime.spawn(run_reporter(Arc::clone(&inner), stopped));
        Ok(Self {
            inner,
            stop: Arc::new(StopOnDrop(stop)),
        })
    }

    /// Records one access to `key` and says whether it is hot now. Never blocks on the network
    /// and never fails.
    pub fn is_hot(&self, key: &[u8]) -> bool {
        self.record(key, 1);
        self.is_hot_now(key)
    }

    /// Whether `key` is hot now, without recording an access.
    pub fn is_hot_now(&self, key: &[u8]) -> bool {
        read(&self.inner.hot)
            .get(key)
            .is_some_and(|entry| entry.until > Instant::now())
    }

    /// Records `count` accesses to `key` (pre-aggregated by the caller).
    pub fn record(&self, key: &[u8], count: u32) {
        let inner = &self.inner;
        inner
            .counters
            .accesses_recorded
            .fetch_add(u64::from(count), Ordering::Relaxed);
        let shard = inner.shard_of(key);
        let mut buffer = lock(&inner.buffer[shard]);
        if let Some(total) = buffer.get_mut(key) {
            *total = total.saturating_add(count);
            return;
        }
        if key.is_empty()
            || inner.buffered_keys.fetch_add(1, Ordering::Relaxed) >= inner.options.buffer_keys_max
        {
            if !key.is_empty() {
                inner.buffered_keys.fetch_sub(1, Ordering::Relaxed);
            }
            inner
                .counters
                .accesses_dropped
                .fetch_add(u64::from(count), Ordering::Relaxed);
            return;
        }
        buffer.insert(key.into(), count);
    }

    /// The cached value of a hot key, if one was set or loaded while it is hot.
    pub fn get(&self, key: &[u8]) -> Option<V> {
        let hot = read(&self.inner.hot);
        let entry = hot.get(key)?;
        if entry.until <= Instant::now() {
            return None;
        }
        entry.value.clone()
    }

    /// Caches `value` for `key` if the key is hot; the value expires when the key cools.
    /// Returns whether it was cached.
    pub fn set(&self, key: &[u8], value: V) -> bool {
        let mut hot = write(&self.inner.hot);
        match hot.get_mut(key) {
            Some(entry) if entry.until > Instant::now() => {
                entry.value = Some(value);
                true
            }
            _ => false,
        }
    }

    /// Records an access and returns the key's value: from the local cache when the key is hot
    /// and cached; else from `load`. While a key is hot, one load runs at a time however many
    /// callers wait for it, and its result is cached; cold keys always call `load`.
    pub async fn get_or_load<F, Fut, E>(&self, key: &[u8], load: F) -> Result<V, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<V, E>>,
    {
        if !self.is_hot(key) {
            return load().await;
        }
        if let Some(value) = self.get(key) {
            return Ok(value);
        }
        let cell = {
            let mut loads = lock(&self.inner.loads);
            Arc::clone(
                loads
                    .entry(key.into())
                    .or_insert_with(|| Arc::new(OnceCell::new())),
            )
        };
        let value = cell.get_or_try_init(load).await?.clone();
        self.set(key, value.clone());
        lock(&self.inner.loads).remove(key);
        Ok(value)
    }

    /// Calls `callback` on every hot and cool event, from a background task: keep it quick.
    pub fn on_change(&self, callback: impl Fn(&HotKeyChange) + Send + Sync + 'static) {
        write(&self.inner.callbacks).push(Box::new(callback));
    }

    /// The keys hot now.
    pub fn hot_keys(&self) -> Vec<Vec<u8>> {
        let now = Instant::now();
        let mut keys: Vec<Vec<u8>> = read(&self.inner.hot)
            .iter()
            .filter(|(_, entry)| entry.until > now)
            .map(|(key, _)| key.to_vec())
            .collect();
        keys.sort();
        keys
    }

    /// The client's counters.
    pub fn stats(&self) -> HotKeysStats {
        let counters = &self.inner.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        HotKeysStats {
            accesses_recorded: load(&counters.accesses_recorded),
            accesses_dropped: load(&counters.accesses_dropped),
            keys_reported: load(&counters.keys_reported),
            keys_unsent: load(&counters.keys_unsent),
            batches_unsent: load(&counters.batches_unsent),
            events_received: load(&counters.events_received),
            sessions_opened: load(&counters.sessions_opened),
            servers_connected: read(&self.inner.links)
                .iter()
                .filter(|link| lock(&link.sender).is_some())
                .count() as u64,
        }
    }

    /// The server (index into `servers`) that `key` is reported to while every server is
    /// connected.
    pub fn server_of(&self, key: &[u8]) -> usize {
        self.inner
            .route(self.inner.key_hash(key), |_| true)
            .unwrap_or(0)
    }

    /// Sends what is buffered now, without waiting for the next report interval.
    pub fn flush(&self) {
        self.inner.flush();
    }

    /// Sends what is buffered now, then stops the background tasks.
    pub fn close(&self) {
        self.inner.flush();
        self.inner.stopping.store(true, Ordering::Relaxed);
        let _ = self.stop.0.send(true);
    }
}

impl<V> Inner<V> {
    fn key_hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn shard_of(&self, key: &[u8]) -> usize {
        // A small modulo of a 64-bit hash fits in usize.
        #[allow(clippy::cast_possible_truncation)]
        let shard = (self.key_hash(key) % BUFFER_SHARDS as u64) as usize;
        shard
    }

    /// Rendezvous hashing over the active servers that `eligible` accepts.
    fn route(&self, key_hash: u64, eligible: impl Fn(usize) -> bool) -> Option<usize> {
        let links = read(&self.links);
        rendezvous(key_hash, links.iter().map(|link| link.seed), |index| {
            links[index].is_active() && eligible(index)
        })
    }

    /// The link of server `server`.
    fn link(&self, server: usize) -> Arc<ServerLink> {
        Arc::clone(&read(&self.links)[server])
    }

    /// Makes `members` (gRPC addresses) the servers: links of servers that left are retired,
    /// new ones get a link and a session.
    fn follow_members(self: &Arc<Self>, members: &[String])
    where
        V: Clone + Send + Sync + 'static,
    {
        let mut links = write(&self.links);
        for link in links.iter() {
            if !members.contains(&link.address) && link.is_active() {
                tracing::info!(server = %link.address, "hot-key server left the cluster");
                link.active.send_replace(false);
            }
        }
        for member in members {
            match links.iter().position(|link| link.address == *member) {
                Some(index) if !links[index].is_active() => {
                    links[index].active.send_replace(true);
                    self.runtime
                        .spawn(run_link(Arc::clone(self), index, self.stopped.clone()));
                }
                Some(_) => {}
                None if links.len() < SERVERS_MAX => {
                    tracing::info!(server = %member, "hot-key server joined the cluster");
                    links.push(Arc::new(ServerLink::new(member, self.hasher)));
                    let index = links.len() - 1;
                    self.runtime
                        .spawn(run_link(Arc::clone(self), index, self.stopped.clone()));
                }
                None => tracing::warn!(
                    server = %member,
                    "more than {SERVERS_MAX} servers seen; not following this one"
                ),
            }
        }
    }

    /// Sends the buffer to the connected servers.
    fn flush(&self) {
        let mut drained = Vec::new();
        for shard in &self.buffer {
            let taken = std::mem::take(&mut *lock(shard));
            self.buffered_keys.fetch_sub(taken.len(), Ordering::Relaxed);
            drained.extend(taken);
        }
        if drained.is_empty() {
            return;
        }
        // The servers as they stand, taken once for the whole round: a key's route is then a
        // rendezvous over plain seeds, with no lock per key.
        let (seeds, senders): (Vec<u64>, Vec<Option<mpsc::Sender<HotKeyClientMessage>>>) =
            read(&self.links)
                .iter()
                .map(|link| {
                    let sender = link
                        .is_active()
                        .then(|| lock(&link.sender).clone())
                        .flatten();
                    (link.seed, sender)
                })
                .unzip();
        let mut per_server: Vec<Vec<KeyReport>> = vec![Vec::new(); senders.len()];
        let mut unsent = 0_u64;
        for (key, count) in drained {
            let route = rendezvous(self.key_hash(&key), seeds.iter().copied(), |index| {
                senders[index].is_some()
            });
            match route {
                Some(server) => per_server[server].push(KeyReport {
                    key: key.into(),
                    count,
                }),
                None => unsent += 1,
            }
        }
        for (server, reports) in per_server.into_iter().enumerate() {
            let Some(sender) = &senders[server] else {
                continue;
            };
            let mut reports = reports;
            while !reports.is_empty() {
                let rest = reports.split_off(batch_length(
                    &reports,
                    self.options.batch_keys_max,
                    self.options.batch_bytes_max,
                ));
                let count = reports.len() as u64;
                let message = HotKeyClientMessage {
                    kind: Some(ClientKind::Report(ReportBatch { keys: reports })),
                };
                if sender.try_send(message).is_ok() {
                    self.counters
                        .keys_reported
                        .fetch_add(count, Ordering::Relaxed);
                } else {
                    unsent += count;
                    self.counters.batches_unsent.fetch_add(1, Ordering::Relaxed);
                }
                reports = rest;
            }
        }
        if unsent > 0 {
            self.counters
                .keys_unsent
                .fetch_add(unsent, Ordering::Relaxed);
        }
    }

    /// Applies a snapshot or event batch from server `server`, then runs the callbacks.
    fn apply(&self, server: usize, events: &[HotKeyEvent], snapshot: bool) {
        let now = Instant::now();
        let mut changes = Vec::with_capacity(events.len());
        {
            let mut hot = write(&self.hot);
            if snapshot {
                let keep: std::collections::HashSet<&[u8]> =
                    events.iter().map(|event| event.key.as_slice()).collect();
                hot.retain(|key, entry| {
                    let stays = entry.server != server || keep.contains(key.as_ref());
                    if !stays {
                        changes.push(HotKeyChange {
                            key: key.to_vec(),
                            hot: false,
                            hot_for: Duration::ZERO,
                            manual: false,
                        });
                    }
                    stays
                });
            }
            for event in events {
                if event.app != self.options.app {
                    continue;
                }
                if event.hot {
                    let hot_for = Duration::from_millis(event.hot_for_ms);
                    let until = now + hot_for;
                    match hot.get_mut(event.key.as_slice()) {
                        Some(entry) => {
                            entry.until = entry.until.max(until);
                            entry.server = server;
                        }
                        None => {
                            hot.insert(
                                event.key.as_slice().into(),
                                LocalHot {
                                    until,
                                    server,
                                    value: None,
                                },
                            );
                        }
                    }
                    changes.push(HotKeyChange {
                        key: event.key.clone(),
                        hot: true,
                        hot_for,
                        manual: event.source == HotKeySource::Manual as i32,
                    });
                } else if hot.remove(event.key.as_slice()).is_some() {
                    changes.push(HotKeyChange {
                        key: event.key.clone(),
                        hot: false,
                        hot_for: Duration::ZERO,
                        manual: false,
                    });
                }
            }
            // Entries whose time ran out go now, so the map stays as small as the hot set.
            hot.retain(|_, entry| entry.until > now);
        }
        self.counters
            .events_received
            .fetch_add(events.len() as u64, Ordering::Relaxed);
        let callbacks = read(&self.callbacks);
        for change in &changes {
            for callback in callbacks.iter() {
                callback(change);
            }
        }
    }
}

/// The eligible server with the highest score `mix(key_hash ^ seed)` for the key.
fn rendezvous(
    key_hash: u64,
    seeds: impl Iterator<Item = u64>,
    eligible: impl Fn(usize) -> bool,
) -> Option<usize> {
    seeds
        .enumerate()
        .filter(|(index, _)| eligible(*index))
        .max_by_key(|(_, seed)| mix(key_hash ^ seed))
        .map(|(index, _)| index)
}

/// A 64-bit finaliser (splitmix64), so that rendezvous scores of nearby seeds are independent.
fn mix(mut value: u64) -> u64 {
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}

async fn run_reporter<V>(inner: Arc<Inner<V>>, mut stopped: watch::Receiver<bool>) {
    let mut interval = tokio::time::interval(inner.options.report_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => inner.flush(),
            _ = stopped.wait_for(|stop| *stop) => return,
        }
    }
}

async fn run_link<V>(inner: Arc<Inner<V>>, server: usize, mut stopped: watch::Receiver<bool>) {
    let link = inner.link(server);
    let mut retired = link.active.subscribe();
    let mut backoff = inner.options.reconnect_backoff_min;
    loop {
        let opened = Instant::now();
        let result = tokio::select! {
            result = session(&inner, server) => result,
            _ = stopped.wait_for(|stop| *stop) => return,
            _ = retired.wait_for(|active| !*active) => {
                *lock(&link.sender) = None;
                return;
            }
        };
        *lock(&link.sender) = None;
        if inner.stopping.load(Ordering::Relaxed) || !link.is_active() {
            return;
        }
        if let Err(error) = result {
            tracing::warn!(
                server = %link.address,
                %error,
                retry_in_ms = backoff.as_millis(),
                "hot-key session failed; reconnecting"
            );
        }
        // A session that lived a while resets the backoff.
        if opened.elapsed() > inner.options.reconnect_backoff_max {
            backoff = inner.options.reconnect_backoff_min;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stopped.wait_for(|stop| *stop) => return,
            _ = retired.wait_for(|active| !*active) => return,
        }
        backoff = (backoff * 2).min(inner.options.reconnect_backoff_max);
    }
}

/// Follows the cluster's members: asks a seed (or a member learnt since) for the
/// `WatchMembers` stream and makes every update the set of servers, until stopped. A stream
/// that ends or fails is opened again elsewhere, with backoff.
async fn run_membership<V: Clone + Send + Sync + 'static>(
    inner: Arc<Inner<V>>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut backoff = inner.options.reconnect_backoff_min;
    let mut turn = 0_usize;
    loop {
        let candidates: Vec<String> = {
            let links = read(&inner.links);
            let mut candidates: Vec<String> = links
                .iter()
                .filter(|link| link.is_active())
                .map(|link| link.address.clone())
                .collect();
            candidates.extend(inner.options.servers.iter().cloned());
            candidates.sort();
            candidates.dedup();
            candidates
        };
        turn = turn.wrapping_add(1);
        let address = candidates[turn % candidates.len()].clone();
        let opened = Instant::now();
        let result = tokio::select! {
            result = watch_members(&inner, &address) => result,
            _ = stopped.wait_for(|stop| *stop) => return,
        };
        match result {
            // A server without the Cluster service: a fixed set of servers, as given.
            Err(error) if error.code() == Some(levee_proto::v1::ErrorCode::Unimplemented) => {
                tracing::info!(server = %address, "server does not list members; not following");
                return;
            }
            Err(error) => tracing::debug!(server = %address, %error, "member stream ended"),
            Ok(()) => tracing::debug!(server = %address, "member stream ended"),
        }
        if opened.elapsed() > inner.options.reconnect_backoff_max {
            backoff = inner.options.reconnect_backoff_min;
        }
        tokio::select! {
            () = tokio::time::sleep(backoff) => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
        backoff = (backoff * 2).min(inner.options.reconnect_backoff_max);
    }
}

/// One `WatchMembers` stream from `address`: each update becomes the set of servers.
async fn watch_members<V: Clone + Send + Sync + 'static>(
    inner: &Arc<Inner<V>>,
    address: &str,
) -> Result<(), ClientError> {
    let client = crate::Client::connect_with(
        address,
        &crate::ClientOptions {
            connect_timeout: inner.options.connect_timeout,
            request_timeout: Duration::from_secs(365 * 24 * 3600),
        },
    )
    .await?;
    let mut updates = client.watch_members().await?;
    while let Some(update) = updates.message().await? {
        let members: Vec<String> = update
            .members
            .iter()
            .map(|member| member.grpc_addr.clone())
            .collect();
        // A server bound to 0.0.0.0 (or [::]) tells no address a client can use: keep the
        // servers as given.
        let unusable = members.iter().find(|address| {
            address.is_empty()
                || address
                    .parse::<std::net::SocketAddr>()
                    .is_ok_and(|address| address.ip().is_unspecified())
        });
        if let Some(unusable) = unusable {
            tracing::warn!(
                server = %address,
                member = %unusable,
                "a member's API address is not one clients can reach; not following the \
                 cluster (bind --grpc-addr to a reachable address, or set follow_cluster false)"
            );
            return Ok(());
        }
        if !members.is_empty() {
            inner.follow_members(&members);
        }
    }
    Ok(())
}

async fn session<V>(inner: &Arc<Inner<V>>, server: usize) -> Result<(), ClientError> {
    let link = inner.link(server);
    let uri = if link.address.contains("://") {
        link.address.clone()
    } else {
        format!("http://{}", link.address)
    };
    let endpoint = Endpoint::from_shared(uri).map_err(|error| ClientError::InvalidAddress {
        address: link.address.clone(),
        reason: error.to_string(),
    })?;
    let channel = endpoint
        .connect_timeout(inner.options.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .connect()
        .await
        .map_err(|source| ClientError::Connect {
            address: link.address.clone(),
            source,
        })?;
    let (sender, receiver) = mpsc::channel(BATCHES_QUEUED_PER_SERVER_MAX);
    let hello = HotKeyClientMessage {
        kind: Some(ClientKind::Hello(Hello {
            app: inner.options.app.clone(),
            client_id: inner.options.client_id.clone(),
        })),
    };
    // A new channel has room for its first message.
    let _ = sender.try_send(hello);
    let mut incoming = HotKeysClient::new(channel)
        .session(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    inner
        .counters
        .sessions_opened
        .fetch_add(1, Ordering::Relaxed);
    *lock(&link.sender) = Some(sender);
    while let Some(message) = incoming.message().await? {
        match message.kind {
            Some(ServerKind::Snapshot(snapshot)) => inner.apply(server, &snapshot.hot, true),
            Some(ServerKind::Events(batch)) => inner.apply(server, &batch.events, false),
            None => {}
        }
    }
    Ok(())
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn read<T>(lock: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    lock.read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// How many of `reports` go in one message: at most `keys_max`, and as many as fit
/// `bytes_max` with their framing and the batch's (at least one, so a round always moves).
fn batch_length(reports: &[KeyReport], keys_max: usize, bytes_max: usize) -> usize {
    let mut bytes = levee_proto::REPORT_BATCH_OVERHEAD_BYTES;
    for (index, report) in reports.iter().take(keys_max).enumerate() {
        bytes += report.key.len() + levee_proto::REPORT_KEY_OVERHEAD_BYTES;
        if bytes > bytes_max {
            return index.max(1);
        }
    }
    reports.len().min(keys_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_reports_then_batches_split_by_keys_and_by_bytes() {
        let report = |bytes: usize| KeyReport {
            key: vec![b'k'; bytes],
            count: 1,
        };
        let small: Vec<KeyReport> = (0..10).map(|_| report(10)).collect();
        assert_eq!(batch_length(&small, 4, 1 << 20), 4, "by keys");
        assert_eq!(
            batch_length(&small, 100, 6 + 3 * 24),
            3,
            "by bytes: 24 each with framing, 6 for the batch"
        );
        assert_eq!(batch_length(&small, 100, 1 << 20), 10);
        let large = vec![report(1_024); 10_000];
        let first = batch_length(&large, 10_000, REPORT_BATCH_BYTES_MAX_DEFAULT);
        assert_eq!(first, (REPORT_BATCH_BYTES_MAX_DEFAULT - 6) / 1_038);
        assert_eq!(
            batch_length(&[report(100)], 10, 50),
            1,
            "one key always goes"
        );
    }

    #[test]
    fn given_server_removed_then_only_its_keys_move_and_they_spread_over_the_rest() {
        let seeds: Vec<u64> = (0..5_u64).map(|server| mix(server + 1)).collect();
        let owner = |key: u64, removed: Option<usize>| {
            rendezvous(mix(key), seeds.iter().copied(), |index| {
                Some(index) != removed
            })
            .unwrap()
        };
        let mut moved_to = [0_u32; 5];
        for key in 0..10_000 {
            let before = owner(key, None);
            let after = owner(key, Some(2));
            if before == 2 {
                assert_ne!(after, 2);
                moved_to[after] += 1;
            } else {
                assert_eq!(before, after, "key {key} moved although its server stayed");
            }
        }
        // The removed server's share spreads over all four others.
        assert!(
            moved_to
                .iter()
                .enumerate()
                .all(|(server, count)| server == 2 || *count > 200)
        );
    }

    #[test]
    fn given_bad_options_then_errors_name_the_option() {
        let mut options = HotKeysOptions::new("shop", vec!["127.0.0.1:1".to_owned()]);
        options.report_interval = Duration::from_millis(600);
        let message = options.validate().unwrap_err().to_string();
        assert!(
            message.contains("report_interval must be 1 to 500 ms"),
            "{message}"
        );
        let options = HotKeysOptions::new("shop", Vec::new());
        assert!(
            options
                .validate()
                .unwrap_err()
                .to_string()
                .contains("servers")
        );
    }

    #[tokio::test]
    async fn given_full_buffer_then_new_keys_are_dropped_and_counted_but_known_keys_add_up() {
        let mut options = HotKeysOptions::new("shop", vec!["127.0.0.1:1".to_owned()]);
        options.buffer_keys_max = 2;
        let client: HotKeys = HotKeys::start(options).unwrap();
        client.record(b"a", 1);
        client.record(b"b", 1);
        client.record(b"c", 5);
        client.record(b"a", 3);
        let stats = client.stats();
        assert_eq!(stats.accesses_recorded, 10);
        assert_eq!(stats.accesses_dropped, 5);
        assert!(!client.is_hot(b"a"), "nothing is hot without a server");
    }
}
