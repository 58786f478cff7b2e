//! A node's watch on the leaders of the shards it follows ([`run`], docs/CLUSTER.md,
//! "Failover"): a leader whose process is gone is replaced at once, not after openraft's
//! timeouts.
//!
//! openraft elects a new leader once a follower heard nothing from its leader for its leader
//! lease (`election_timeout_max`, 300 ms) plus its election timeout (150 to 300 ms). Under
//! appends the two followers' logs differ by an entry or two, and the first to call an
//! election is often the one with the shorter log: refused, it waits its timeout again plus
//! `2 * election_timeout_max` before it tries again, while the other splits the next vote
//! with it. A shard's failover then took 0.45 to 1.9 s, about 1.1 s at the median.
//!
//! Most failures a cluster meets are a process that stopped (a crash, kill -9, an
//! out-of-memory kill, a restart) on a host that is still up: its ports then refuse
//! connections at once. So a follower whose leader sent nothing (no entries, no heartbeat:
//! openraft sends one every 50 ms) for [`LEADER_SILENT_AFTER`] opens a TCP connection to the
//! leader's peer port. Refused: the leader's process is gone, and the follower calls an
//! election of every shard that leader led, then again every [`ELECTION_PAUSE`] plus up to as
//! much again at random, at most [`ELECTIONS_MAX`] times, until the shard has another leader.
//! Both followers do it (neither votes while the lease of the old leader runs, unless it
//! called an election itself): their first calls split the vote, and a later one, apart in
//! time, wins. A node whose vote request a replica with a longer log refused calls no more:
//! that replica calls and wins (openraft holds the shorter log's timer back), and a call
//! from the shorter log would only raise the term past it again. A node that granted its
//! vote to another candidate within [`GRANT_WAIT`] does not call: that candidate may have
//! its majority and lead, and a call in a newer term before its first heartbeat arrived
//! would unseat it. An episode's calls leave this node a candidate (no leader known), so
//! they start no new episode; one ends when another leader is known.
//!
//! Accepted, timed out, or any other error: the leader may be alive but slow, or its host
//! unreachable, and openraft's timeouts decide, as before.
//!
//! Electing sooner changes no guarantee: an election is safe whenever it is called (Raft's
//! vote and log checks), and a leader that cannot reach a majority acknowledges nothing.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use openraft::ServerState;

use crate::NodeId;
use crate::shard::ShardId;
use crate::shard::groups::ShardGroups;

/// How long a follower hears nothing from its shard's leader before it asks whether the
/// leader's process is there: three heartbeats.
pub const LEADER_SILENT_AFTER: Duration = Duration::from_millis(150);
/// How often the watch looks at the shards.
pub const WATCH_INTERVAL: Duration = Duration::from_millis(25);
/// Longest a connection to a leader's peer port may take to open or be refused; a probe
/// that takes longer says nothing (a slow host, or one that cannot be reached).
pub const PROBE_TIMEOUT: Duration = Duration::from_millis(100);
/// Least time between two probes of one peer.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(100);
/// Least pause between two elections this node calls of a shard whose leader is gone; up to
/// as much again is added at random, so that two followers calling at once split one vote,
/// not every one.
pub const ELECTION_PAUSE: Duration = Duration::from_millis(50);
/// Most elections a node calls of one shard per leader found gone; openraft's own timeouts
/// go on after them.
pub const ELECTIONS_MAX: u32 = 8;
/// How long a node that granted its vote of a shard to a candidate calls no election of it.
pub const GRANT_WAIT: Duration = Duration::from_millis(100);

/// When each shard last heard from its leader: milliseconds since a start, per shard.
#[derive(Debug)]
pub struct Heard {
    start: Instant,
    at_ms: Vec<AtomicU64>,
    /// Per shard: when this node last granted its vote.
    granted_ms: Vec<AtomicU64>,
    /// Per shard: when a replica with a longer log last refused this node's vote request.
    outlogged_ms: Vec<AtomicU64>,
}

impl Heard {
    /// Nothing heard yet of any of `shards` (silent since now).
    pub fn new(shards: u32) -> Self {
        Self {
            start: Instant::now(),
            at_ms: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            granted_ms: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            outlogged_ms: (0..shards).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// `shard`'s leader was heard from now (an `AppendEntries` call, entries or heartbeat).
    pub fn hear(&self, shard: ShardId) {
        self.mark(&self.at_ms, shard);
    }

    /// This node granted its vote of `shard` to a candidate now.
    pub fn granted(&self, shard: ShardId) {
        self.mark(&self.granted_ms, shard);
    }

    /// A replica of `shard` whose log is longer than this node's refused its vote request now.
    pub fn outlogged(&self, shard: ShardId) {
        self.mark(&self.outlogged_ms, shard);
    }

    /// How long since a replica with a longer log last refused this node's vote request of
    /// `shard` (since the start if never).
    pub fn since_outlogged(&self, shard: ShardId) -> Duration {
        self.since(&self.outlogged_ms, shard)
    }

    /// How long `shard` has heard nothing from its leader.
    pub fn silent_for(&self, shard: ShardId) -> Duration {
        self.since(&self.at_ms, shard)
    }

    /// How long since this node last granted its vote of `shard` (since the start if never).
    pub fn since_granted(&self, shard: ShardId) -> Duration {
        self.since(&self.granted_ms, shard)
    }

    fn mark(&self, times_ms: &[AtomicU64], shard: ShardId) {
        if let Some(at_ms) = times_ms.get(shard as usize) {
            at_ms.store(self.ms_since_start(), Ordering::Relaxed);
        }
    }

    fn since(&self, times_ms: &[AtomicU64], shard: ShardId) -> Duration {
        let at_ms = times_ms
            .get(shard as usize)
            .map_or(0, |at_ms| at_ms.load(Ordering::Relaxed));
        Duration::from_millis(self.ms_since_start().saturating_sub(at_ms))
    }

    fn ms_since_start(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// What the watch sees of one shard here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// This node's role in the shard.
    pub state: ServerState,
    /// Whether this node is one of the shard's voters.
    pub voter: bool,
    /// The leader this node knows.
    pub leader: Option<NodeId>,
    /// How long the shard has heard nothing from its leader.
    pub silent_for: Duration,
    /// How long since this node granted its vote of the shard to a candidate.
    pub since_granted: Duration,
    /// How long since a replica with a longer log refused this node's vote request.
    pub since_outlogged: Duration,
}

/// Elections called of one shard since its leader was found gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Episode {
    /// The leader found gone.
    pub gone: NodeId,
    /// Elections called so far.
    pub calls: u32,
    /// When the next call is due.
    pub next: Instant,
    /// When the leader was found gone.
    pub began: Instant,
}

/// What the watch does about one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Nothing (and any episode of the shard is over).
    Nothing,
    /// Asks whether the leader's process is there.
    Probe(NodeId),
    /// Waits for the episode's next call, or for the candidate this node voted for.
    Wait,
    /// Calls an election (the episode's next call).
    Elect,
}

/// The watch's decision for a shard this node (`me`) replicates, seen as `seen`, with the
/// episode under way (if any), at `now`.
pub fn step(me: NodeId, seen: &Seen, episode: Option<&Episode>, now: Instant) -> Step {
    if seen.state == ServerState::Leader || !seen.voter {
        return Step::Nothing;
    }
    match episode {
        Some(episode) => {
            if seen.leader.is_some_and(|leader| leader != episode.gone)
                || episode.calls >= ELECTIONS_MAX
                || seen.since_outlogged < now.saturating_duration_since(episode.began)
            {
                // Another leader is known, or a replica with a longer log refused this
                // node's vote (it calls, and openraft holds this node back), or the calls are
                // spent: openraft goes on.
                Step::Nothing
            } else if now >= episode.next && seen.since_granted >= GRANT_WAIT {
                Step::Elect
            } else {
                Step::Wait
            }
        }
        None => match seen.leader {
            Some(leader) if leader != me && seen.silent_for >= LEADER_SILENT_AFTER => {
                Step::Probe(leader)
            }
            _ => Step::Nothing,
        },
    }
}

/// The pause after an election call: [`ELECTION_PAUSE`] plus up to as much again at random.
fn pause() -> Duration {
    let random = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    let extra_ms = random
        % u64::try_from(ELECTION_PAUSE.as_millis())
            .unwrap_or(1)
            .max(1);
    ELECTION_PAUSE + Duration::from_millis(extra_ms)
}

/// Whether `peer_addr` refuses connections now: true only for a refusal, within
/// [`PROBE_TIMEOUT`].
pub async fn refuses(peer_addr: &str) -> bool {
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect(peer_addr)).await,
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// Watches the leaders of the shards `groups` follows every [`WATCH_INTERVAL`] until
/// `stopping` turns true; see the module's text.
pub async fn run(groups: ShardGroups, mut stopping: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(WATCH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Per peer: when it was last probed, and whether it refused.
    let mut probed: HashMap<NodeId, (Instant, bool)> = HashMap::new();
    let mut episodes: HashMap<ShardId, Episode> = HashMap::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stopping.wait_for(|stopping| *stopping) => return,
        }
        for shard in 0..groups.shards() {
            let Some((seen, peer_addr)) = groups.watched(shard) else {
                continue;
            };
            let now = Instant::now();
            match step(groups.node_id(), &seen, episodes.get(&shard), now) {
                Step::Nothing => {
                    episodes.remove(&shard);
                }
                Step::Wait => {}
                Step::Probe(leader) => {
                    let gone = match probed.get(&leader) {
                        Some((at, gone)) if now.duration_since(*at) < PROBE_INTERVAL => *gone,
                        _ => {
                            let gone = match &peer_addr {
                                Some(address) => refuses(address).await,
                                None => false,
                            };
                            probed.insert(leader, (Instant::now(), gone));
                            gone
                        }
                    };
                    if gone {
                        tracing::info!(
                            shard,
                            leader,
                            "the shard's leader's process is gone (its peer port refuses \
                             connections): calling an election"
                        );
                        groups.observer().leader_gone(shard);
                        let episode = Episode {
                            gone: leader,
                            calls: 0,
                            next: now,
                            began: now,
                        };
                        episodes.insert(shard, call(&groups, shard, episode));
                    }
                }
                Step::Elect => {
                    if let Some(episode) = episodes.remove(&shard) {
                        episodes.insert(shard, call(&groups, shard, episode));
                    }
                }
            }
        }
    }
}

/// Calls an election of `shard` (on a task of its own) and returns the episode after it.
fn call(groups: &ShardGroups, shard: ShardId, episode: Episode) -> Episode {
    if let Some(raft) = groups.raft(shard) {
        let raft = raft.clone();
        tokio::spawn(async move {
            if let Err(error) = raft.trigger().elect().await {
                tracing::debug!(%error, shard, "calling an election of the shard");
            }
        });
    }
    Episode {
        calls: episode.calls + 1,
        next: Instant::now() + pause(),
        ..episode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn following(leader: NodeId, silent_ms: u64) -> Seen {
        Seen {
            state: ServerState::Follower,
            voter: true,
            leader: Some(leader),
            silent_for: Duration::from_millis(silent_ms),
            since_granted: Duration::from_secs(60),
            since_outlogged: Duration::from_secs(60),
        }
    }

    #[test]
    fn given_a_leader_heard_within_three_heartbeats_then_nothing_is_asked() {
        let now = Instant::now();
        assert_eq!(step(1, &following(2, 149), None, now), Step::Nothing);
        assert_eq!(step(1, &following(2, 150), None, now), Step::Probe(2));
    }

    #[test]
    fn given_this_node_leads_or_is_no_voter_or_knows_no_leader_then_it_never_probes() {
        let now = Instant::now();
        let leading = Seen {
            state: ServerState::Leader,
            ..following(1, 10_000)
        };
        let learner = Seen {
            voter: false,
            state: ServerState::Learner,
            ..following(2, 10_000)
        };
        let leaderless = Seen {
            leader: None,
            ..following(2, 10_000)
        };
        for seen in [leading, learner, leaderless, following(1, 10_000)] {
            assert_eq!(step(1, &seen, None, now), Step::Nothing, "{seen:?}");
        }
    }

    #[test]
    fn given_a_leader_found_gone_then_elections_are_called_apart_until_another_leads() {
        let now = Instant::now();
        let episode = Episode {
            gone: 2,
            calls: 1,
            next: now + ELECTION_PAUSE,
            began: now,
        };
        // This node is a candidate now: no leader known.
        let electing = Seen {
            state: ServerState::Candidate,
            leader: None,
            ..following(2, 500)
        };
        assert_eq!(step(1, &electing, Some(&episode), now), Step::Wait);
        assert_eq!(
            step(1, &electing, Some(&episode), now + ELECTION_PAUSE),
            Step::Elect
        );
        // The gone leader is still the one known: the calls go on.
        assert_eq!(
            step(1, &following(2, 500), Some(&episode), now + ELECTION_PAUSE),
            Step::Elect
        );
        // Another node leads: over.
        assert_eq!(
            step(1, &following(3, 0), Some(&episode), now + ELECTION_PAUSE),
            Step::Nothing
        );
        // This node leads: over.
        let leading = Seen {
            state: ServerState::Leader,
            leader: Some(1),
            ..following(1, 0)
        };
        assert_eq!(step(1, &leading, Some(&episode), now), Step::Nothing);
        // This node granted its vote to node 3 a moment ago: node 3 is given time to lead.
        let granted = Seen {
            state: ServerState::Follower,
            leader: None,
            since_granted: GRANT_WAIT / 2,
            ..following(2, 500)
        };
        assert_eq!(
            step(1, &granted, Some(&episode), now + ELECTION_PAUSE),
            Step::Wait
        );
        let waited = Seen {
            since_granted: GRANT_WAIT,
            ..granted
        };
        assert_eq!(
            step(1, &waited, Some(&episode), now + ELECTION_PAUSE),
            Step::Elect,
            "node 3 did not lead in time: this node calls again"
        );
        // A replica with a longer log refused this node's vote since the episode began.
        let outlogged = Seen {
            since_outlogged: ELECTION_PAUSE / 2,
            ..electing.clone()
        };
        assert_eq!(
            step(1, &outlogged, Some(&episode), now + ELECTION_PAUSE),
            Step::Nothing
        );
        // ... but one refused it before the episode: it calls.
        let before = Seen {
            since_outlogged: ELECTION_PAUSE * 2,
            ..electing
        };
        assert_eq!(
            step(1, &before, Some(&episode), now + ELECTION_PAUSE),
            Step::Elect
        );
    }

    #[test]
    fn given_the_calls_spent_then_openraft_is_left_to_decide() {
        let now = Instant::now();
        let spent = Episode {
            gone: 2,
            calls: ELECTIONS_MAX,
            next: now,
            began: now,
        };
        assert_eq!(
            step(1, &following(2, 900), Some(&spent), now),
            Step::Nothing
        );
    }

    #[test]
    fn given_pauses_then_each_is_between_one_and_two_election_pauses() {
        for _ in 0..100 {
            let pause = pause();
            assert!(
                pause >= ELECTION_PAUSE && pause < ELECTION_PAUSE * 2,
                "{pause:?}"
            );
        }
    }

    #[tokio::test]
    async fn given_a_closed_port_then_it_refuses_and_an_open_one_does_not() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let open = listener.local_addr().expect("its address").to_string();
        assert!(!refuses(&open).await, "a listening port accepts");
        drop(listener);
        assert!(refuses(&open).await, "a closed port refuses");
    }

    #[test]
    fn given_a_shard_heard_from_then_its_silence_restarts() {
        let heard = Heard::new(2);
        std::thread::sleep(Duration::from_millis(20));
        heard.hear(1);
        assert!(heard.silent_for(0) >= Duration::from_millis(20));
        assert!(heard.silent_for(1) < Duration::from_millis(20));
        assert!(
            heard.silent_for(7) >= Duration::from_millis(20),
            "a shard not known is silent since the start"
        );
        heard.granted(0);
        heard.outlogged(1);
        assert!(heard.since_granted(0) < Duration::from_millis(20));
        assert!(heard.since_granted(1) >= Duration::from_millis(20));
        assert!(heard.since_outlogged(1) < Duration::from_millis(20));
        assert!(heard.since_outlogged(0) >= Duration::from_millis(20));
    }
}
