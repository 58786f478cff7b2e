//! Opening a store: list the segment files, check their headers, scan every record in order
//! to rebuild the queues and the index, truncate a torn or corrupt tail of the last segment and
//! report what was done.
//!
//! This module owns the steps of an open in order ([`recover`]: list, lock, find the floor,
//! replay each segment, settle the queues into lock shards) and what it returns
//! ([`Recovered`], [`OpenReport`]). The replay, in the order a record goes through it:
//!
//! - `scan.rs`: reading a segment through a window ([`Scanner`]), framing and checksumming
//!   each record, skipping log records before the floor, and routing each to its lock shard.
//! - `replay.rs`: applying the checked records to the queues being rebuilt, on the scanning
//!   thread or on two applying threads a window behind it.
//! - `rebuild.rs`: one queue being rebuilt from its chunk, trim and log records, settled
//!   into a queue's state at the end.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::OpenError;
use crate::format::{
    self, FLOOR_RECORD_BYTES, FORMAT_VERSION, HeaderProblem, LogFloor, Record, SEGMENT_HEADER_BYTES,
};
use crate::options::StoreOptions;
use crate::storage::{LOCK_FILE_NAME, Storage, StorageFile};
use crate::store::{Listed, QueueKey, SHARD_COUNT, SegmentEntry, Shard};

use rebuild::Recovering;
use replay::{ApplyState, Replay};
use scan::ScanState;
pub(crate) use scan::Scanner;

mod rebuild;
mod replay;
mod scan;
#[cfg(test)]
mod tests;

/// The first format version whose segments start with a floor record.
const FLOOR_VERSION: u32 = 3;
/// The first format version with log batch records.
const LOG_BATCH_VERSION: u32 = 4;

/// What [`crate::Store::open`] found and did; worth logging.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// Segment files in use after recovery.
    pub segments: u64,
    /// Records scanned.
    pub records: u64,
    /// Log records skipped unread: before the log floor, so their messages are in chunks.
    pub log_records_skipped: u64,
    /// Bytes scanned.
    pub bytes_scanned: u64,
    /// Queues recovered.
    pub queues: u64,
    /// Retained messages recovered.
    pub messages: u64,
    /// Torn or corrupt tails cut off (never served).
    pub truncated: Vec<TruncatedTail>,
    /// Files removed: a last segment too short to hold its header.
    pub removed_files: Vec<String>,
    /// Files in the directory that are not segments (left alone).
    pub ignored_files: Vec<String>,
    /// Time the recovery took.
    pub elapsed: Duration,
}

/// A tail cut off the last segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TruncatedTail {
    /// The segment file.
    pub file: String,
    /// Where the file was cut.
    pub position: u64,
    /// Bytes removed.
    pub bytes_dropped: u64,
    /// Why the first removed record was refused.
    pub reason: String,
}

pub(crate) struct Recovered {
    pub shards: Vec<Shard>,
    pub segments: BTreeMap<u32, SegmentEntry>,
    pub active_segment: u32,
    pub active_file: Arc<dyn StorageFile>,
    pub active_bytes: u64,
    pub next_incarnation: u64,
    pub file_syncs: u64,
    pub dir_syncs: u64,
    pub report: OpenReport,
    /// Queues whose log records hold messages not in any chunk: they get write buffers again.
    pub buffered: VecDeque<Listed>,
    /// Budget bytes of those buffers.
    pub buffered_bytes: usize,
    /// Oldest segment that may hold a needed log record.
    pub log_floor: u32,
    /// The floor this recovery used: every log record it replayed is at or after it.
    pub floor: LogFloor,
}

type RecoveringMap = HashMap<Arc<[u8]>, Recovering, foldhash::fast::FixedState>;

/// Why a record was refused during recovery.
enum Problem {
    /// Framing or checksum damage: a torn write at the tail, corruption elsewhere.
    Damaged(String),
    /// A well-formed record that contradicts the records before it.
    Inconsistent(String),
}

fn io_error(operation: String) -> impl FnOnce(std::io::Error) -> OpenError {
    move |source| OpenError::Io { operation, source }
}

/// Opens segment `id`: its file name, the file and its length.
fn open_segment(
    storage: &dyn Storage,
    id: u32,
) -> Result<(String, Arc<dyn StorageFile>, u64), OpenError> {
    let name = format::segment_file_name(id);
    let file = storage
        .open(&name)
        .map_err(io_error(format!("opening {name}")))?;
    let length = file
        .len()
        .map_err(io_error(format!("reading the length of {name}")))?;
    Ok((name, file, length))
}

/// Recovers the store in `storage` (ARCHITECTURE-store.md, recovery): on three threads where
/// there are two cores or more, else on one.
pub(crate) fn recover(
    storage: &dyn Storage,
    options: &StoreOptions,
) -> Result<Recovered, OpenError> {
    let parallel = std::thread::available_parallelism().is_ok_and(|cores| cores.get() > 1);
    recover_on(storage, options, parallel)
}

/// [`recover`], on one thread or (`parallel`) on three.
#[allow(
    clippy::too_many_lines,
    reason = "the recovery steps in order, easier to audit in one place"
)]
fn recover_on(
    storage: &dyn Storage,
    options: &StoreOptions,
    parallel: bool,
) -> Result<Recovered, OpenError> {
    let started = Instant::now();
    let mut report = OpenReport::default();
    let mut file_syncs = 0;
    let mut dir_syncs = 0;
    let names = storage
        .list()
        .map_err(io_error("listing the data directory".to_string()))?;
    let mut ids: Vec<u32> = Vec::new();
    for name in names {
        if name == LOCK_FILE_NAME {
            continue;
        }
        match format::parse_segment_file_name(&name) {
            Some(id) => ids.push(id),
            None => report.ignored_files.push(name),
        }
    }
    ids.sort_unstable();
    report.ignored_files.sort();
    if ids.is_empty() && !report.ignored_files.is_empty() {
        let mut found = String::from("no segment files, but ");
        let shown: Vec<&str> = report
            .ignored_files
            .iter()
            .take(5)
            .map(String::as_str)
            .collect();
        let _ = write!(
            found,
            "{} other files ({})",
            report.ignored_files.len(),
            shown.join(", ")
        );
        return Err(OpenError::NotAStore {
            directory: "the data directory".to_string(),
            found,
        });
    }
    // Locked only once the directory looks like a store, so a wrong path gets no LOCK file.
    storage
        .lock_directory()
        .map_err(io_error("locking the data directory".to_string()))?;
    let floor = find_floor(storage, &ids)?;
    let hasher = crate::store::shard_hasher();
    let mut replay = Replay {
        scan: ScanState {
            floor,
            log_records_skipped: 0,
            hasher,
            chunk_records: BTreeMap::new(),
            segment_version: FORMAT_VERSION,
        },
        apply: ApplyState {
            shards: (0..SHARD_COUNT).map(|_| RecoveringMap::default()).collect(),
            chunk_bytes: options.chunk_bytes,
            next_incarnation: 0,
        },
        parallel,
    };
    let mut segments = BTreeMap::new();
    let mut active: Option<(u32, Arc<dyn StorageFile>, u64, u32)> = None;
    for (index, &id) in ids.iter().enumerate() {
        let last = index + 1 == ids.len();
        let (name, file, length) = open_segment(storage, id)?;
        if length < SEGMENT_HEADER_BYTES {
            if !last {
                return Err(OpenError::Corrupt {
                    file: name,
                    position: 0,
                    reason: format!("{length} bytes, shorter than the segment header"),
                });
            }
            storage
                .remove(&name)
                .map_err(io_error(format!("removing {name}")))?;
            storage
                .sync_dir()
                .map_err(io_error("fsyncing the data directory".to_string()))?;
            dir_syncs += 1;
            report.removed_files.push(name);
            continue;
        }
        let version = check_header(file.as_ref(), &name, id)?;
        replay.scan.segment_version = version;
        let end = replay.scan(id, &name, file.as_ref(), length, last, &mut report)?;
        if end < length {
            file.truncate(end)
                .map_err(io_error(format!("truncating {name}")))?;
            file.sync().map_err(io_error(format!("fsyncing {name}")))?;
            file_syncs += 1;
        }
        report.bytes_scanned += end;
        let chunks_total = replay.scan.chunk_records.get(&id).copied().unwrap_or(0);
        segments.insert(
            id,
            SegmentEntry {
                file: file.clone(),
                live_chunks: 0,
                chunks_total,
            },
        );
        active = Some((id, file, end, version));
    }
    // Records of this version are never appended to a segment of an older one (whose header
    // tells an older build it can read it): such a store continues in a new segment.
    let (active_segment, active_file, active_bytes) = match active {
        Some((id, file, end, version)) if version >= FORMAT_VERSION => (id, file, end),
        older_or_none => {
            let id = match older_or_none {
                Some((id, ..)) => id + 1,
                None => ids.last().map_or(1, |last| last + 1),
            };
            let file = create_segment(storage, id, floor)?;
            file_syncs += 1;
            dir_syncs += 1;
            segments.insert(
                id,
                SegmentEntry {
                    file: file.clone(),
                    live_chunks: 0,
                    chunks_total: 0,
                },
            );
            (id, file, SEGMENT_HEADER_BYTES + FLOOR_RECORD_BYTES as u64)
        }
    };
    report.log_records_skipped = replay.scan.log_records_skipped;
    let first_id = ids.first().copied().unwrap_or(0);
    let last_id = segments.keys().next_back().copied().unwrap_or(first_id);
    let live_slots = usize::try_from(last_id - first_id + 1).unwrap_or(usize::MAX);
    let mut maps = replay.apply.shards;
    let upper_maps = maps.split_off(SHARD_COUNT / 2);
    let finish_half = |maps: Vec<RecoveringMap>| finish_shards(maps, first_id, live_slots);
    let (lower, upper) = if replay.parallel {
        std::thread::scope(|scope| {
            let upper = scope.spawn(move || finish_half(upper_maps));
            let lower = finish_half(maps);
            // Invariant: finishing returns errors rather than panicking.
            (lower, upper.join().expect("recovery finisher finished"))
        })
    } else {
        (finish_half(maps), finish_half(upper_maps))
    };
    let corrupt = |reason| OpenError::Corrupt {
        file: "the log".to_string(),
        position: 0,
        reason,
    };
    let (mut lower, upper) = (lower.map_err(corrupt)?, upper.map_err(corrupt)?);
    lower.shards.extend(upper.shards);
    let shards = lower.shards;
    report.queues = lower.queues + upper.queues;
    report.messages = lower.messages + upper.messages;
    let buffered: VecDeque<Listed> = lower.buffered.into_iter().chain(upper.buffered).collect();
    let buffered_bytes = lower.buffered_bytes + upper.buffered_bytes;
    for (id, segment) in &mut segments {
        let slot = usize::try_from(id - first_id).unwrap_or(usize::MAX);
        segment.live_chunks += lower.live_chunks.get(slot).copied().unwrap_or(0)
            + upper.live_chunks.get(slot).copied().unwrap_or(0);
    }
    report.segments = segments.len() as u64;
    report.elapsed = started.elapsed();
    // Buffers rebuilt from log records pin every segment until a checkpoint seals them.
    let log_floor = if buffered.is_empty() {
        active_segment
    } else {
        segments.keys().next().copied().unwrap_or(active_segment)
    };
    Ok(Recovered {
        floor,
        buffered,
        buffered_bytes,
        log_floor,
        shards,
        segments,
        active_segment,
        active_file,
        active_bytes,
        next_incarnation: replay.apply.next_incarnation,
        file_syncs,
        dir_syncs,
        report,
    })
}

/// Queues of some lock shards, rebuilt.
struct FinishedShards {
    shards: Vec<Shard>,
    queues: u64,
    messages: u64,
    /// Live chunks per segment, by segment id minus the first segment's.
    live_chunks: Vec<u64>,
    /// Queues with messages only in log records: they get write buffers again.
    buffered: Vec<Listed>,
    buffered_bytes: usize,
}

/// Settles every queue of `maps` (see [`Recovering::finish`]) into lock shards; counts live
/// chunks per segment from `first_id` in `live_slots` slots.
fn finish_shards(
    maps: Vec<RecoveringMap>,
    first_id: u32,
    live_slots: usize,
) -> Result<FinishedShards, String> {
    let mut finished = FinishedShards {
        shards: Vec::with_capacity(maps.len()),
        queues: 0,
        messages: 0,
        live_chunks: vec![0; live_slots],
        buffered: Vec::new(),
        buffered_bytes: 0,
    };
    for recovering in maps {
        let mut shard = Shard::default();
        shard.queues.reserve(recovering.len());
        for (name, queue) in recovering {
            let state = queue.finish()?;
            finished.queues += 1;
            finished.messages += state.next_offset - state.first_offset;
            for chunk in state.chunks.iter() {
                let slot = chunk
                    .segment
                    .checked_sub(first_id)
                    .map(|slot| slot as usize);
                if let Some(live) = slot.and_then(|slot| finished.live_chunks.get_mut(slot)) {
                    *live += 1;
                }
            }
            if let Some(buffer) = &state.buffer {
                finished.buffered_bytes += buffer.budget_bytes();
                // Round 0 stands for the replayed log, which starts at `floor`.
                finished.buffered.push(Listed {
                    key: QueueKey {
                        name: state.name.clone(),
                        incarnation: state.incarnation,
                    },
                    since_round: 0,
                });
            }
            shard.queues.insert(name, state);
        }
        finished.shards.push(shard);
    }
    Ok(finished)
}

/// Refuses a segment whose header is not a Levee header of a version this build reads naming
/// segment `id`; returns its format version.
fn check_header(file: &dyn StorageFile, name: &str, id: u32) -> Result<u32, OpenError> {
    let name = name.to_string();
    let mut header = [0_u8; 32];
    file.read_at(0, &mut header)
        .map_err(io_error(format!("reading the header of {name}")))?;
    match format::decode_segment_header(&header) {
        Ok(header_id) if header_id == u64::from(id) => Ok(format::read_u32(&header, 8)),
        Ok(header_id) => Err(OpenError::Corrupt {
            file: name,
            position: 16,
            reason: format!("header names segment {header_id}"),
        }),
        Err(HeaderProblem::NotLevee(magic)) => Err(OpenError::NotAStore {
            directory: "the data directory".to_string(),
            found: format!("{name} starts with bytes {magic:02x?}, not a Levee segment"),
        }),
        Err(HeaderProblem::Version(found)) => Err(OpenError::UnsupportedVersion {
            file: name,
            found,
            supported: FORMAT_VERSION,
        }),
        Err(HeaderProblem::Damaged(reason)) => Err(OpenError::Corrupt {
            file: name,
            position: 0,
            reason: reason.to_string(),
        }),
    }
}

/// The newest log floor: the floor record at the start of the newest segment of a version
/// that has them (a last segment whose first record is torn has nothing after it: the one
/// before is used). No floor (nothing skipped) if there is none.
fn find_floor(storage: &dyn Storage, ids: &[u32]) -> Result<LogFloor, OpenError> {
    const HEADER_BYTES: usize = 32;
    for &id in ids.iter().rev() {
        let (name, file, length) = open_segment(storage, id)?;
        let mut start = [0_u8; HEADER_BYTES + FLOOR_RECORD_BYTES];
        if length < start.len() as u64 {
            continue;
        }
        file.read_at(0, &mut start)
            .map_err(io_error(format!("reading the start of {name}")))?;
        let header: [u8; HEADER_BYTES] = start[..HEADER_BYTES].try_into().unwrap_or([0; 32]);
        if format::decode_segment_header(&header).is_err() {
            // Refused with the reason by the scan.
            continue;
        }
        if format::read_u32(&header, 8) < FLOOR_VERSION {
            // Older segments have no floor records.
            break;
        }
        if let Ok(Record::Floor(floor)) = format::decode_checked(&start[HEADER_BYTES..]) {
            return Ok(floor);
        }
    }
    Ok(LogFloor::default())
}

/// Creates segment `id` with its header and floor record: create, write, fsync the file,
/// fsync the directory.
fn create_segment(
    storage: &dyn Storage,
    id: u32,
    floor: LogFloor,
) -> Result<Arc<dyn StorageFile>, OpenError> {
    let name = format::segment_file_name(id);
    let file = storage
        .create(&name)
        .map_err(io_error(format!("creating {name}")))?;
    let mut start = format::encode_segment_header(id).to_vec();
    format::encode_floor(&mut start, floor);
    file.write_at(0, &start)
        .and_then(|()| file.sync())
        .map_err(io_error(format!("writing the header of {name}")))?;
    storage
        .sync_dir()
        .map_err(io_error("fsyncing the data directory".to_string()))?;
    Ok(file)
}
