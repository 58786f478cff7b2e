//! [`Limiter`]: cluster-wide limits decided locally (docs/LIMITS.md). `try_acquire(resource,
//! permits)` spends permits from the lease this client holds for the resource: an atomic
//! decrement, no network, never failing. A background task keeps one `Limits.Leases` session
//! with the cluster's leader and, a little before each lease ends, asks for each resource's
//! lease of the next period, sized from the permits the application asked for in the last
//! period (its demand), so a lease is held without a gap; the grants of a period never pass the
//! resource's budget, so the cap can only be missed from below.
//!
//! While no lease is held (at start, for the first period; while the leader cannot be reached)
//! a resource answers from its **fallback**: `fallback_permits` per lease period for this
//! client alone (0 by default: refuse), counted in [`LimiterStats::fallback_decisions`].

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use levee_proto::v1::limits_client::LimitsClient;
use levee_proto::v1::{BreakerStatus, LeaseDemand, LeaseRequest, LeaseResponse, MemberRole};
use tokio::sync::{mpsc, watch};

use crate::error::ClientError;
use crate::limit_keys::{CallReports, KeyShares, LimitCall};

/// How a [`Limiter`] connects and falls back.
#[derive(Debug, Clone)]
pub struct LimiterOptions {
    /// Any of the cluster's nodes (the limiter finds the leader).
    pub servers: Vec<String>,
    /// How often leases are renewed: the server's lease period (100 ms).
    pub lease_interval: Duration,
    /// Permits per lease period a resource may use while no lease is held (0: refuse).
    pub fallback_permits: u64,
    /// Most time to connect.
    pub connect_timeout: Duration,
}

impl LimiterOptions {
    /// Options against `servers`, refusing while no lease is held.
    pub fn new(servers: Vec<String>) -> Self {
        Self {
            servers,
            lease_interval: Duration::from_millis(100),
            fallback_permits: 0,
            connect_timeout: Duration::from_secs(2),
        }
    }
}

/// What a limiter did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimiterStats {
    /// Permits admitted.
    pub admitted: u64,
    /// Permits refused.
    pub refused: u64,
    /// Decisions taken from the fallback (no lease held).
    pub fallback_decisions: u64,
    /// Lease answers received.
    pub leases_received: u64,
    /// Permits refused by a key's share of a per-key limit (also counted in `refused`).
    pub key_refused: u64,
    /// Permits of leases that expired unspent (granted, not used: the cap missed from below).
    pub expired_unspent: u64,
    /// Permits granted in leases (top-ups included).
    pub granted: u64,
    /// Permits given back before their lease ended (for clients that ran short).
    pub returned: u64,
    /// Whether a lease session is open now.
    pub connected: bool,
}

/// One lease: permits to spend between its start and its expiry (nanoseconds since the
/// limiter started).
#[derive(Debug, Default)]
struct Slot {
    tokens: AtomicU64,
    starts_ns: AtomicU64,
    expires_ns: AtomicU64,
}

impl Slot {
    fn is_current(&self, now: u64) -> bool {
        self.starts_ns.load(Ordering::Acquire) <= now
            && now < self.expires_ns.load(Ordering::Acquire)
    }
}

/// One resource's leases, as the application spends them: the current one and the next (asked
/// for a little before the current one ends).
#[derive(Debug, Default)]
struct Resource {
    slots: [Slot; 2],
    /// Permits the application asked for since the last lease request.
    wanted: AtomicU64,
    /// Permits left of the fallback in this period.
    fallback: AtomicU64,
    /// Calls reported since the last lease request.
    calls: CallReports,
    /// The rule's breaker, as the last grant said (a `BreakerStatus`).
    breaker: AtomicI32,
    /// The per-key shares the grants carried (none: the rule limits no key).
    keys: Mutex<Option<KeyShares>>,
}

impl Resource {
    /// In the last fifth of the current lease (when the next one is asked for), gives back
    /// what it holds beyond what the recent demand (`demand` over `since_ns`) needs until it
    /// ends, with 5% to spare (rounded up): those permits are taken out of the lease, and the
    /// server may grant them to clients that ran short. Never while the rule's breaker is
    /// half-open (the permits are its probes).
    fn give_back(&self, now: u64, demand: u64, since_ns: u64, period_ns: u64) -> u64 {
        if self.breaker.load(Ordering::Relaxed) == BreakerStatus::HalfOpen as i32 {
            return 0;
        }
        let Some(slot) = self.slots.iter().find(|slot| slot.is_current(now)) else {
            return 0;
        };
        let rest_ns = slot.expires_ns.load(Ordering::Acquire).saturating_sub(now);
        if rest_ns > period_ns / 5 {
            return 0;
        }
        let need = (u128::from(demand) * u128::from(rest_ns) * 21)
            .div_ceil(20 * u128::from(since_ns.max(1)));
        let need = u64::try_from(need).unwrap_or(u64::MAX);
        let mut given = 0;
        let _ = slot
            .tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                given = left.saturating_sub(need);
                (given > 0).then(|| left - given)
            });
        given
    }
}

#[derive(Debug)]
struct Inner {
    options: LimiterOptions,
    client_id: u64,
    started: Instant,
    resources: RwLock<HashMap<String, Arc<Resource>>>,
    connected: AtomicBool,
    admitted: AtomicU64,
    refused: AtomicU64,
    fallback_decisions: AtomicU64,
    leases_received: AtomicU64,
    key_refused: AtomicU64,
    expired_unspent: AtomicU64,
    granted: AtomicU64,
    returned: AtomicU64,
    /// When the last lease request was made.
    last_request_ns: AtomicU64,
}

/// Most resources one limiter follows.
pub const RESOURCES_MAX: usize = 1_000;

/// Cluster-wide limits, decided locally from leases. Cheap to clone; clones share everything.
/// Dropping the last clone stops the background task.
#[derive(Debug, Clone)]
pub struct Limiter {
    inner: Arc<Inner>,
    _stop: Arc<watch::Sender<bool>>,
}

/// Takes `permits` from `counter` if it holds that many.
fn take(counter: &AtomicU64, permits: u64) -> bool {
    counter
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
            left.checked_sub(permits)
        })
        .is_ok()
}

impl Limiter {
    /// Starts the lease session in the background on the current tokio runtime.
    pub fn start(options: LimiterOptions) -> Result<Self, ClientError> {
        if options.servers.is_empty() || options.lease_interval.is_zero() {
            return Err(ClientError::InvalidOptions(
                "servers: give at least one server; lease_interval: above 0".to_owned(),
            ));
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
            ClientError::InvalidOptions("Limiter::start must run inside a tokio runtime".into())
        })?;
        let started = Instant::now();
        let client_id = (u64::from(std::process::id()) << 32
            ^ u64::try_from(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |since| since.as_nanos()),
            )
            .unwrap_or(1))
        .max(1);
        let inner = Arc::new(Inner {
            options,
            client_id,
            started,
            resources: RwLock::new(HashMap::new()),
            connected: AtomicBool::new(false),
            admitted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            fallback_decisions: AtomicU64::new(0),
            leases_received: AtomicU64::new(0),
            key_refused: AtomicU64::new(0),
            expired_unspent: AtomicU64::new(0),
            granted: AtomicU64::new(0),
            returned: AtomicU64::new(0),
            last_request_ns: AtomicU64::new(0),
        });
        let (stop, stopped) = watch::channel(false);
        runtime.spawn(run_leases(Arc::clone(&inner), stopped));
        Ok(Self {
            inner,
            _stop: Arc::new(stop),
        })
    }

    /// This limiter's client id in its lease session.
    pub fn client_id(&self) -> u64 {
        self.inner.client_id
    }

    /// Takes `permits` of `resource` if the lease (or the fallback) has them. Never blocks and
    /// never fails; a resource first asked for here is leased from the next period on.
    pub fn try_acquire(&self, resource: &str, permits: u64) -> bool {
        let inner = &self.inner;
        let known = inner
            .resources
            .read()
            .ok()
            .and_then(|map| map.get(resource).cloned());
        let Some(state) = known.or_else(|| self.follow(resource)) else {
            inner.refused.fetch_add(permits, Ordering::Relaxed);
            return false;
        };
        decide(inner, &state, permits)
    }

    /// Takes `permits` of `key` of `resource`: the key's share of the rule's per-key limit
    /// (answered locally), then the resource's lease, as [`Self::try_acquire`]. A key refused
    /// by its limit is counted refused and not as demand. A rule without per-key limits
    /// limits no key.
    pub fn try_acquire_key(&self, resource: &str, key: &[u8], permits: u64) -> bool {
        match self.resource(resource) {
            Some(handle) => handle.try_acquire_key(key, permits),
            None => self.try_acquire(resource, permits),
        }
    }

    /// Takes `permits` of `resource`, waiting for them up to `deadline` (a later lease, or the
    /// fallback); false if they did not come in time. The demand is counted once, however long
    /// it waits; it polls the lease every [`ACQUIRE_POLL`].
    pub async fn acquire(
        &self,
        resource: &str,
        permits: u64,
        deadline: tokio::time::Instant,
    ) -> bool {
        match self.resource(resource) {
            Some(handle) => handle.acquire(permits, deadline).await,
            None => self.try_acquire(resource, permits),
        }
    }

    /// A handle on `resource` for the hot path: its `try_acquire` skips the lookup by name.
    /// `None` when the limiter already follows [`RESOURCES_MAX`] other resources.
    pub fn resource(&self, resource: &str) -> Option<LimitedResource> {
        let known = self
            .inner
            .resources
            .read()
            .ok()
            .and_then(|map| map.get(resource).cloned());
        known
            .or_else(|| self.follow(resource))
            .map(|state| LimitedResource {
                inner: Arc::clone(&self.inner),
                state,
            })
    }

    /// Starts following `resource` (at most [`RESOURCES_MAX`]).
    fn follow(&self, resource: &str) -> Option<Arc<Resource>> {
        let mut resources = self.inner.resources.write().ok()?;
        if let Some(state) = resources.get(resource) {
            return Some(Arc::clone(state));
        }
        if resources.len() >= RESOURCES_MAX {
            return None;
        }
        let state = Arc::new(Resource::default());
        state
            .fallback
            .store(self.inner.options.fallback_permits, Ordering::Relaxed);
        resources.insert(resource.to_owned(), Arc::clone(&state));
        Some(state)
    }

    /// What the limiter did so far.
    pub fn stats(&self) -> LimiterStats {
        let inner = &self.inner;
        LimiterStats {
            admitted: inner.admitted.load(Ordering::Relaxed),
            refused: inner.refused.load(Ordering::Relaxed),
            fallback_decisions: inner.fallback_decisions.load(Ordering::Relaxed),
            leases_received: inner.leases_received.load(Ordering::Relaxed),
            key_refused: inner.key_refused.load(Ordering::Relaxed),
            expired_unspent: inner.expired_unspent.load(Ordering::Relaxed),
            granted: inner.granted.load(Ordering::Relaxed),
            returned: inner.returned.load(Ordering::Relaxed),
            connected: inner.connected.load(Ordering::Relaxed),
        }
    }
}

/// Spends `permits` of `state`'s current lease, or of its fallback while it holds none.
fn decide(inner: &Inner, state: &Resource, permits: u64) -> bool {
    state.wanted.fetch_add(permits, Ordering::Relaxed);
    let now = inner.now_ns();
    let current = state.slots.iter().find(|slot| slot.is_current(now));
    let admitted = if let Some(slot) = current {
        take(&slot.tokens, permits)
    } else {
        inner.fallback_decisions.fetch_add(1, Ordering::Relaxed);
        take(&state.fallback, permits)
    };
    let counter = if admitted {
        &inner.admitted
    } else {
        &inner.refused
    };
    counter.fetch_add(permits, Ordering::Relaxed);
    admitted
}

/// A resource's handle: [`LimitedResource::try_acquire`] decides without looking the name up.
#[derive(Debug, Clone)]
pub struct LimitedResource {
    inner: Arc<Inner>,
    state: Arc<Resource>,
}

impl LimitedResource {
    /// Takes `permits` if the lease (or the fallback) has them; as [`Limiter::try_acquire`].
    pub fn try_acquire(&self, permits: u64) -> bool {
        decide(&self.inner, &self.state, permits)
    }

    /// Takes `permits` of `key`: its per-key share, then the lease; as
    /// [`Limiter::try_acquire_key`].
    pub fn try_acquire_key(&self, key: &[u8], permits: u64) -> bool {
        let now = self.inner.now_ns();
        let key_admitted = self
            .state
            .keys
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
            .is_none_or(|shares| shares.try_acquire(key, permits, now));
        if !key_admitted {
            self.inner.refused.fetch_add(permits, Ordering::Relaxed);
            self.inner.key_refused.fetch_add(permits, Ordering::Relaxed);
            return false;
        }
        self.try_acquire(permits)
    }

    /// Takes one permit and, if it came, a [`LimitCall`] that reports how the call ended (its
    /// outcome and latency feed the rule's breaker and adaptive budget on the server).
    pub fn try_call(&self) -> Option<LimitCall> {
        self.try_acquire(1).then(|| LimitCall {
            resource: self.clone(),
            started: Instant::now(),
            reported: false,
        })
    }

    /// Reports a call that ended (for callers that time their own calls): sent with the next
    /// lease request.
    pub fn record(&self, succeeded: bool, latency: Duration) {
        self.state.calls.record(succeeded, latency);
    }

    /// The rule's breaker as the last grant said: `Unspecified` when the rule has none (or no
    /// grant came yet), `Open` while the server grants nothing.
    pub fn breaker(&self) -> BreakerStatus {
        BreakerStatus::try_from(self.state.breaker.load(Ordering::Relaxed))
            .unwrap_or(BreakerStatus::Unspecified)
    }

    /// Takes `permits`, waiting up to `deadline`; as [`Limiter::acquire`].
    pub async fn acquire(&self, permits: u64, deadline: tokio::time::Instant) -> bool {
        if self.try_acquire(permits) {
            return true;
        }
        // Counted as wanted and refused once above; a waiter wants its permits again in each
        // later lease period (leases are sized from demand), and is not counted again as
        // refused.
        let inner = &self.inner;
        let mut wanted_again = tokio::time::Instant::now() + LEASE_PERIOD;
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return false;
            }
            if now >= wanted_again {
                self.state.wanted.fetch_add(permits, Ordering::Relaxed);
                wanted_again = now + LEASE_PERIOD;
            }
            tokio::time::sleep_until(deadline.min(now + ACQUIRE_POLL)).await;
            let now_ns = inner.now_ns();
            let tokens = match self.state.slots.iter().find(|slot| slot.is_current(now_ns)) {
                Some(slot) => &slot.tokens,
                None => &self.state.fallback,
            };
            if take(tokens, permits) {
                inner.refused.fetch_sub(permits, Ordering::Relaxed);
                inner.admitted.fetch_add(permits, Ordering::Relaxed);
                return true;
            }
        }
    }
}

/// How often a waiting [`Limiter::acquire`] looks at the lease again (a lease period is
/// 100 ms).
pub const ACQUIRE_POLL: Duration = Duration::from_millis(5);
/// A lease period, as the server's rules give it (`LeaseRule.window_ns`, 100 ms).
const LEASE_PERIOD: Duration = Duration::from_millis(100);

impl Inner {
    fn now_ns(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The request of this period: each resource's demand since the last one.
    fn request(&self) -> LeaseRequest {
        let now = self.now_ns();
        let since_ns = now.saturating_sub(self.last_request_ns.swap(now, Ordering::AcqRel));
        let period_ns = u64::try_from(self.options.lease_interval.as_nanos()).unwrap_or(u64::MAX);
        let resources = self.resources.read().map(|map| {
            map.iter()
                .map(|(resource, state)| {
                    let demand = state.wanted.swap(0, Ordering::AcqRel);
                    (resource, state, demand)
                })
                .map(|(resource, state, demand)| LeaseDemand {
                    resource: resource.clone(),
                    demand,
                    returned: state.give_back(now, demand, since_ns, period_ns),
                    stats: state.calls.take(),
                    keys_version: state
                        .keys
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .as_ref()
                        .map_or(0, KeyShares::version),
                })
                .collect()
        });
        self.returned.fetch_add(
            resources.as_ref().map_or(0, |demands: &Vec<LeaseDemand>| {
                demands.iter().map(|demand| demand.returned).sum()
            }),
            Ordering::Relaxed,
        );
        LeaseRequest {
            client_id: self.client_id,
            demands: resources.unwrap_or_default(),
        }
    }

    /// Applies an answer: each lease replaces the last.
    fn apply(&self, answer: &LeaseResponse, sent_ns: u64) {
        self.leases_received.fetch_add(1, Ordering::Relaxed);
        let Ok(resources) = self.resources.read() else {
            return;
        };
        let now = self.now_ns();
        for grant in &answer.grants {
            let Some(state) = resources.get(&grant.resource) else {
                continue;
            };
            state.breaker.store(grant.breaker, Ordering::Relaxed);
            if grant.top_up > 0
                && let Some(slot) = state.slots.iter().find(|slot| slot.is_current(now))
            {
                slot.tokens.fetch_add(grant.top_up, Ordering::AcqRel);
                self.granted.fetch_add(grant.top_up, Ordering::Relaxed);
            }
            state.calls.slow_call_ns.store(
                grant.slow_call_ms.saturating_mul(1_000_000),
                Ordering::Relaxed,
            );
            if let Some(limits) = &grant.key_limits {
                *state.keys.lock().unwrap_or_else(PoisonError::into_inner) = KeyShares::new(limits);
            }
            // Times count from when the lease was asked for, so a lease never outlives the
            // server's period; it goes in the slot that is not being spent now.
            let at = |ms: u64| sent_ns.saturating_add(ms.saturating_mul(1_000_000));
            let slot = state
                .slots
                .iter()
                .find(|slot| !slot.is_current(now))
                .unwrap_or(&state.slots[0]);
            let left = slot.tokens.swap(0, Ordering::AcqRel);
            if slot.expires_ns.load(Ordering::Acquire) <= now {
                self.expired_unspent.fetch_add(left, Ordering::Relaxed);
            }
            if grant.unknown_resource {
                slot.expires_ns.store(0, Ordering::Release);
                continue;
            }
            // The next lease takes over the moment the current one expires (the times are
            // rounded to milliseconds and shifted by the request's trip, which would otherwise
            // leave a gap of a millisecond or two each period).
            let current_end = state
                .slots
                .iter()
                .filter(|other| !std::ptr::eq(*other, slot) && other.is_current(now))
                .map(|other| other.expires_ns.load(Ordering::Acquire))
                .min();
            let starts = at(grant.starts_in_ms);
            slot.starts_ns.store(
                current_end.map_or(starts, |end| end.min(starts)),
                Ordering::Release,
            );
            slot.expires_ns.store(at(grant.valid_ms), Ordering::Release);
            slot.tokens.store(grant.permits, Ordering::Release);
            self.granted.fetch_add(grant.permits, Ordering::Relaxed);
        }
    }

    /// Refills every resource's fallback for a new period.
    fn refill_fallback(&self) {
        if let Ok(resources) = self.resources.read() {
            for state in resources.values() {
                state
                    .fallback
                    .store(self.options.fallback_permits, Ordering::Relaxed);
            }
        }
    }
}

/// Keeps a lease session with the leader until stopped, reconnecting after failures.
async fn run_leases(inner: Arc<Inner>, mut stopped: watch::Receiver<bool>) {
    let mut turn = 0_usize;
    loop {
        turn = turn.wrapping_add(1);
        let seed = inner.options.servers[turn % inner.options.servers.len()].clone();
        tokio::select! {
            result = session(&inner, &seed) => {
                if let Err(error) = result {
                    tracing::debug!(server = %seed, %error, "limits lease session ended");
                }
            }
            _ = stopped.wait_for(|stop| *stop) => return,
        }
        inner.connected.store(false, Ordering::Relaxed);
        inner.refill_fallback();
        tokio::select! {
            () = tokio::time::sleep(inner.options.lease_interval) => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
    }
}

/// One session: finds the leader through `seed`, then renews leases every period.
async fn session(inner: &Arc<Inner>, seed: &str) -> Result<(), ClientError> {
    let options = crate::ClientOptions {
        connect_timeout: inner.options.connect_timeout,
        request_timeout: Duration::from_secs(365 * 24 * 3600),
    };
    let seed_client = crate::Client::connect_with(seed, &options).await?;
    let view = seed_client.cluster().await?;
    let leader = view
        .members
        .iter()
        .find(|member| member.role() == MemberRole::Leader)
        .map_or_else(|| seed.to_owned(), |member| member.grpc_addr.clone());
    let client = crate::Client::connect_with(&leader, &options).await?;
    let (requests, receiver) = mpsc::channel(2);
    let mut answers = LimitsClient::new(client.channel())
        .leases(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await?
        .into_inner();
    inner.connected.store(true, Ordering::Relaxed);
    loop {
        let sent = inner.now_ns();
        if requests.send(inner.request()).await.is_err() {
            return Ok(());
        }
        // A leader whose host vanished without closing the connection answers nothing: give
        // up on it after the connect timeout and a period, and fall back meanwhile.
        let waited = inner.options.connect_timeout + inner.options.lease_interval;
        let Ok(answer) = tokio::time::timeout(waited, answers.message()).await else {
            return Err(ClientError::Server(levee_proto::WireError::new(
                levee_proto::v1::ErrorCode::Unavailable,
                format!(
                    "no lease answer from {leader} within {} ms",
                    waited.as_millis()
                ),
            )));
        };
        let Some(answer) = answer? else {
            return Ok(());
        };
        inner.apply(&answer, sent);
        // The next request goes a little before these leases end, in the last fifth of the
        // server's period: its answer is the next period's lease, so there is no gap.
        let ends_in = answer
            .grants
            .iter()
            .filter(|grant| !grant.unknown_resource)
            .map(|grant| Duration::from_millis(grant.valid_ms))
            .min()
            .unwrap_or(inner.options.lease_interval)
            .min(inner.options.lease_interval * 2);
        let ahead = inner.options.lease_interval / 10;
        let next = ends_in
            .saturating_sub(ahead)
            .max(inner.options.lease_interval / 20);
        tokio::time::sleep(next).await;
    }
}
