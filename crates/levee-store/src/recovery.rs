//! Opening a store: list the segment files, check their headers, scan every record in order
//! to rebuild the queues and the index, truncate a torn or corrupt tail of the last segment and
//! report what was done.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crate::error::OpenError;
use crate::format::{
    self, FLOOR_RECORD_BYTES, FORMAT_VERSION, HeaderProblem, LogFloor, RECORD_BODY_BYTES_MAX,
    RECORD_HEADER_BYTES, Record, SEGMENT_HEADER_BYTES,
};
use crate::options::StoreOptions;
use crate::queue::{ChunkEntry, QueueState, WriteBuffer};
use crate::storage::{LOCK_FILE_NAME, Storage, StorageFile};
use crate::store::{Listed, QueueKey, SHARD_COUNT, SegmentEntry, Shard};

/// Bytes read at a time while scanning a segment.
const SCAN_BLOCK_BYTES: usize = 4 << 20;
/// Read windows queued between the scanning and the applying thread (besides the one each
/// holds): the log alternates between stretches of chunk records (work for the applier) and of
/// skipped log records (work for the scanner only), and a queue lets the applier catch up
/// meanwhile. Bounds the memory at a few windows more.
const WINDOWS_QUEUED: usize = 16;
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

/// Replays the records: a scanning side (read, frame, checksum) and an applying side (rebuild
/// the queues), run on two threads where there are two cores, one window apart.
struct Replay {
    scan: ScanState,
    apply: ApplyState,
    /// Scan and apply on two threads.
    parallel: bool,
}

/// What scanning needs: it checks records and queues them for [`ApplyState`].
struct ScanState {
    hasher: foldhash::fast::FixedState,
    /// Chunk records seen per segment.
    chunk_records: BTreeMap<u32, u64>,
    /// Format version of the segment being scanned.
    segment_version: u32,
    /// Log records before this are skipped (their messages are in chunks).
    floor: LogFloor,
    /// Log records skipped so far.
    log_records_skipped: u64,
}

/// The queues being rebuilt.
struct ApplyState {
    shards: Vec<RecoveringMap>,
    /// The store's chunk size: a tail grows toward it (see `WriteBuffer::push_toward_chunk`).
    chunk_bytes: usize,
    /// Next incarnation for a queue created by the replay.
    next_incarnation: u64,
}

/// A queue being rebuilt. Chunks may arrive out of offset order (a live chunk relocated
/// from an old segment is copied to the end of the log), so offsets are settled in `finish`.
struct Recovering {
    name: Arc<[u8]>,
    incarnation: u64,
    /// Segment of the latest trim record, or [`crate::queue::NO_SEGMENT`].
    trim_segment: u32,
    /// The chunks in offset order, with their sizes: one deque, so replaying a record touches
    /// one place in memory (`state.chunks` is filled in `finish`).
    chunks: VecDeque<RecoveredChunk>,
    /// Highest first retained offset of the replayed trim records.
    trimmed_to: u64,
    /// Messages after the chunks known only from log records, framed as in a write buffer
    /// (boxed: most queues have none, and a small entry keeps the replay's map small).
    tail: Option<Box<WriteBuffer>>,
}

/// One chunk of a queue being rebuilt.
#[derive(Debug, Clone, Copy)]
struct RecoveredChunk {
    entry: ChunkEntry,
    /// Record bytes, header included.
    record_bytes: u32,
    /// Messages in the chunk.
    count: u32,
}

impl RecoveredChunk {
    fn end_offset(&self) -> u64 {
        self.entry.first_offset + u64::from(self.count)
    }
}

impl Recovering {
    fn new(name: Arc<[u8]>, incarnation: u64, trimmed_to: u64) -> Self {
        Self {
            name,
            incarnation,
            trim_segment: crate::queue::NO_SEGMENT,
            chunks: VecDeque::new(),
            trimmed_to,
            tail: None,
        }
    }

    /// End of the chunks, or the trim point if later.
    fn chunks_end(&self) -> u64 {
        self.chunks.back().map_or(self.trimmed_to, |last| {
            last.end_offset().max(self.trimmed_to)
        })
    }

    /// Drops the tail messages before `offset`.
    fn drop_tail_before(&mut self, offset: u64) {
        let Some(tail) = self.tail.as_mut() else {
            return;
        };
        if offset <= tail.first_offset {
            return;
        }
        if offset >= tail.end_offset() {
            tail.reset(offset);
            return;
        }
        let drop = usize::try_from(offset - tail.first_offset).unwrap_or(usize::MAX);
        let position = tail.position_of(offset);
        tail.frozen = drop;
        tail.frozen_bytes = position;
        tail.drain_front(drop, position);
    }

    /// Replays a log record, or one run of a log batch (`count` messages of queue `name` from
    /// offset `start`): its messages past what chunks and the tail already hold join the tail.
    fn add_log<'a>(
        &mut self,
        (name, start, count): (&[u8], u64, u32),
        messages: impl Iterator<Item = &'a [u8]>,
        chunk_bytes: usize,
    ) -> Result<(), Problem> {
        let end = start + u64::from(count);
        let tail_count = self.tail.as_ref().map_or(0, |tail| tail.count);
        let have = match &self.tail {
            Some(tail) if tail.count > 0 => tail.end_offset(),
            _ => self.chunks_end(),
        };
        if end <= have {
            return Ok(());
        }
        if start > have && tail_count > 0 {
            return Err(Problem::Inconsistent(format!(
                "log record of queue {:?} at offsets {start}..{end} leaves a gap after {have}",
                String::from_utf8_lossy(name)
            )));
        }
        let tail = self.tail.get_or_insert_with(Box::default);
        if tail_count == 0 {
            // If `start > have`, the chunks before it are relocated copies still to come (their
            // originals sat in a deleted segment), or were trimmed: `finish` checks which.
            tail.reset(have.max(start));
        }
        let skip = usize::try_from(have.saturating_sub(start)).unwrap_or(usize::MAX);
        for message in messages.skip(skip) {
            tail.push_toward_chunk(message, chunk_bytes);
        }
        Ok(())
    }

    fn add_chunk(
        &mut self,
        chunk: &format::Chunk<'_>,
        entry: ChunkEntry,
        record_bytes: u32,
    ) -> Result<(), Problem> {
        let start = chunk.first_offset;
        let end = start + u64::from(chunk.count);
        if end <= self.trimmed_to {
            return Ok(());
        }
        let recovered = RecoveredChunk {
            entry,
            record_bytes,
            count: chunk.count,
        };
        // The usual case: the chunk follows the last one.
        if self
            .chunks
            .back()
            .is_none_or(|last| last.end_offset() <= start)
        {
            self.chunks.push_back(recovered);
            self.drop_tail_before(end);
            return Ok(());
        }
        let inconsistent = |what: &str| {
            Problem::Inconsistent(format!(
                "chunk of queue {:?} at offsets {start}..{end} {what}",
                String::from_utf8_lossy(chunk.name)
            ))
        };
        let index = self
            .chunks
            .partition_point(|known| known.entry.first_offset < start);
        if let Some(known) = self.chunks.get_mut(index)
            && known.entry.first_offset == start
        {
            // A copy of a relocated chunk: it replaces the original.
            if known.count != chunk.count {
                return Err(inconsistent("differs from the chunk it copies"));
            }
            known.entry = entry;
            known.record_bytes = record_bytes;
            return Ok(());
        }
        if self
            .tail
            .as_ref()
            .is_some_and(|tail| tail.count > 0 && start > tail.first_offset)
        {
            return Err(inconsistent("starts inside messages only logged so far"));
        }
        if index > 0 && self.chunks[index - 1].end_offset() > start {
            return Err(inconsistent("overlaps the chunk before it"));
        }
        if self
            .chunks
            .get(index)
            .is_some_and(|next| end > next.entry.first_offset)
        {
            return Err(inconsistent("overlaps the chunk after it"));
        }
        self.chunks.insert(index, recovered);
        Ok(())
    }

    fn trim(&mut self, first_retained_offset: u64, segment: u32) {
        self.trim_segment = segment;
        self.trimmed_to = self.trimmed_to.max(first_retained_offset);
        while self
            .chunks
            .front()
            .is_some_and(|front| front.end_offset() <= self.trimmed_to)
        {
            self.chunks.pop_front();
        }
        self.drop_tail_before(self.trimmed_to);
    }

    /// Settles the offsets: the queue starts at its first chunk (older chunks sat in deleted
    /// segments) or its trim point, and its chunks must follow each other without a gap.
    fn finish(self) -> Result<QueueState, String> {
        let mut state = QueueState::new(self.name, self.incarnation, self.trimmed_to);
        state.trim_segment = self.trim_segment;
        state.first_offset = self.chunks.front().map_or(self.trimmed_to, |front| {
            front.entry.first_offset.max(self.trimmed_to)
        });
        state.next_offset = self.trimmed_to;
        for (index, chunk) in self.chunks.iter().enumerate() {
            let start = chunk.entry.first_offset;
            if index > 0 && start != state.next_offset {
                return Err(format!(
                    "queue {:?} has no chunk for offsets {}..{start}",
                    String::from_utf8_lossy(&state.name),
                    state.next_offset
                ));
            }
            state.next_offset = chunk.end_offset();
        }
        state.next_offset = state.next_offset.max(self.trimmed_to);
        if let Some(mut tail) = self.tail.filter(|tail| tail.count > 0) {
            if tail.first_offset != state.next_offset && !self.chunks.is_empty() {
                return Err(format!(
                    "queue {:?} has no chunk or log record for offsets {}..{}",
                    String::from_utf8_lossy(&state.name),
                    state.next_offset,
                    tail.first_offset
                ));
            }
            if self.chunks.is_empty() {
                state.first_offset = tail.first_offset.max(self.trimmed_to);
            }
            tail.logged_end = tail.end_offset();
            state.next_offset = tail.end_offset();
            state.queued = true;
            state.buffer = Some(tail);
        }
        state.stored_bytes = self
            .chunks
            .iter()
            .map(|chunk| u64::from(chunk.record_bytes))
            .sum();
        // Exactly sized: an idle queue keeps no growth slack for the past.
        state.chunks = self.chunks.iter().map(|chunk| chunk.entry).collect();
        Ok(state)
    }
}

fn io_error(operation: String) -> impl FnOnce(std::io::Error) -> OpenError {
    move |source| OpenError::Io { operation, source }
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
        let name = format::segment_file_name(id);
        let file = storage
            .open(&name)
            .map_err(io_error(format!("opening {name}")))?;
        let length = file
            .len()
            .map_err(io_error(format!("reading the length of {name}")))?;
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
        let name = format::segment_file_name(id);
        let file = storage
            .open(&name)
            .map_err(io_error(format!("opening {name}")))?;
        let length = file
            .len()
            .map_err(io_error(format!("reading the length of {name}")))?;
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

/// Why a record was refused during recovery.
enum Problem {
    /// Framing or checksum damage: a torn write at the tail, corruption elsewhere.
    Damaged(String),
    /// A well-formed record that contradicts the records before it.
    Inconsistent(String),
}

/// Reads a segment through a window of [`SCAN_BLOCK_BYTES`].
pub(crate) struct Scanner<'a> {
    file: &'a dyn StorageFile,
    length: u64,
    /// The buffer; its first `filled` bytes are the file's from `window_start`.
    window: Vec<u8>,
    filled: usize,
    window_start: u64,
}

impl<'a> Scanner<'a> {
    pub(crate) fn new(file: &'a dyn StorageFile, length: u64) -> Self {
        Self {
            file,
            length,
            window: Vec::new(),
            filled: 0,
            window_start: 0,
        }
    }

    /// Whether `count` bytes at `position` are in the current window (no read needed).
    fn contains(&self, position: u64, count: usize) -> bool {
        position >= self.window_start
            && position + count as u64 <= self.window_start + self.filled as u64
    }

    /// `count` bytes at `position`; the caller keeps `position + count` within the length.
    pub(crate) fn bytes(&mut self, position: u64, count: usize) -> std::io::Result<&[u8]> {
        if !self.contains(position, count) {
            let left = usize::try_from(self.length - position).unwrap_or(usize::MAX);
            let read = count.max(SCAN_BLOCK_BYTES).min(left);
            if self.window.len() < read {
                self.window.resize(read, 0);
            }
            self.filled = 0;
            self.file.read_at(position, &mut self.window[..read])?;
            self.filled = read;
            self.window_start = position;
        }
        let start = usize::try_from(position - self.window_start).unwrap_or(usize::MAX);
        Ok(&self.window[start..start + count])
    }

    /// Hands the window's buffer to `flush` (which leaves another in its place): the next
    /// read fills the new one.
    fn flush_window(
        &mut self,
        pending: &mut Vec<PendingRecord>,
        flush: &mut Flush<'_>,
    ) -> Result<(), (u64, String)> {
        self.filled = 0;
        flush(&mut self.window, pending)
    }
}

/// Called with the scanner's window and the checked records in it before the window moves:
/// applies them (or hands them to the applying thread) and leaves both empty for reuse.
type Flush<'f> = dyn FnMut(&mut Vec<u8>, &mut Vec<PendingRecord>) -> Result<(), (u64, String)> + 'f;

/// Applying threads where there are two cores or more: each rebuilds the queues of its share
/// of the shards.
const APPLIERS: usize = 2;

/// Says an applying thread refused a record; its own error replaces this one.
const APPLIER_FAILED: &str = "a record contradicts the log (see the applying thread's error)";

impl Replay {
    /// Applies every record of one segment; returns where the valid records end. With two
    /// cores, a second thread applies each window's records while this one reads and checks
    /// the next window.
    fn scan(
        &mut self,
        segment: u32,
        name: &str,
        file: &dyn StorageFile,
        length: u64,
        last: bool,
        report: &mut OpenReport,
    ) -> Result<u64, OpenError> {
        let version = self.scan.segment_version;
        let scan = &mut self.scan;
        if !self.parallel {
            let mut ranges = self.apply.ranges(1);
            let range = &mut ranges[0];
            let mut flush = |window: &mut Vec<u8>, pending: &mut Vec<PendingRecord>| {
                let applied = range.apply(window, pending, segment, version);
                pending.clear();
                applied
            };
            let scanned = scan.scan(segment, name, file, length, last, report, &mut flush);
            let next_incarnation = ranges[0].next_incarnation;
            self.apply.next_incarnation = next_incarnation;
            return scanned;
        }
        let failed = &AtomicBool::new(false);
        let ranges = self.apply.ranges(APPLIERS);
        let (next_incarnation, scanned) = std::thread::scope(|scope| {
            // Each window goes to every applier, each applying the records of its own shards
            // (a queue's records stay in log order); the last one done returns the buffers.
            let (returned, spares) = mpsc::sync_channel::<Batch>(WINDOWS_QUEUED + 1);
            let mut senders = Vec::with_capacity(APPLIERS);
            let mut appliers = Vec::with_capacity(APPLIERS);
            for mut range in ranges {
                let (batches, received) = mpsc::sync_channel::<Arc<Batch>>(WINDOWS_QUEUED);
                senders.push(batches);
                let returned = returned.clone();
                appliers.push(scope.spawn(move || {
                    let mut applied = Ok(());
                    for batch in received {
                        if applied.is_ok() {
                            applied = range.apply(&batch.0, &batch.1, segment, version);
                            if applied.is_err() {
                                failed.store(true, Ordering::Relaxed);
                            }
                        }
                        // A window grown for one large record, or a full return queue (the
                        // scanner is done): the buffers are dropped.
                        if let Some((window, mut pending)) = Arc::into_inner(batch)
                            && window.len() <= SCAN_BLOCK_BYTES
                        {
                            pending.clear();
                            let _ = returned.try_send((window, pending));
                        }
                    }
                    applied.map(|()| range.next_incarnation)
                }));
            }
            drop(returned);
            let mut flush = move |window: &mut Vec<u8>, pending: &mut Vec<PendingRecord>| {
                if failed.load(Ordering::Relaxed) {
                    return Err((0, APPLIER_FAILED.to_string()));
                }
                let (spare_window, spare_pending) = spares.try_recv().unwrap_or_default();
                let full = Arc::new((
                    std::mem::replace(window, spare_window),
                    std::mem::replace(pending, spare_pending),
                ));
                // The scanner keeps no reference, so an applier is always the last holder.
                let gone = |_| (0, APPLIER_FAILED.to_string());
                if let Some((last, others)) = senders.split_last() {
                    for sender in others {
                        sender.send(Arc::clone(&full)).map_err(gone)?;
                    }
                    last.send(full).map_err(gone)?;
                }
                Ok(())
            };
            let scanned = scan.scan(segment, name, file, length, last, report, &mut flush);
            // Closes the channels: the appliers end after the last window.
            drop(flush);
            let mut next_incarnation = 0;
            let mut first_error: Option<(u64, String)> = None;
            for applier in appliers {
                // Invariant: `apply` returns errors rather than panicking on any input.
                match applier.join().expect("recovery applier finished") {
                    Ok(next) => next_incarnation = next_incarnation.max(next),
                    Err(error) => {
                        if first_error.as_ref().is_none_or(|first| error.0 < first.0) {
                            first_error = Some(error);
                        }
                    }
                }
            }
            // The appliers' records all precede any damage the scan found.
            let scanned = match first_error {
                Some((position, reason)) => Err(OpenError::Corrupt {
                    file: name.to_string(),
                    position,
                    reason,
                }),
                None => scanned,
            };
            (next_incarnation, scanned)
        });
        self.apply.next_incarnation = self.apply.next_incarnation.max(next_incarnation);
        scanned
    }
}

/// A read window and the checked records in it.
type Batch = (Vec<u8>, Vec<PendingRecord>);

/// The queues of a run of shards, rebuilt by one applying thread, and how that thread numbers
/// the queues it creates: `next_incarnation`, then every `step`th number after it, so two
/// threads never hand out the same one.
struct ShardRange<'a> {
    shards: &'a mut [RecoveringMap],
    /// Index of `shards[0]` among all shards.
    first: usize,
    next_incarnation: u64,
    step: u64,
    chunk_bytes: usize,
}

impl ApplyState {
    /// The shards split into `parts` runs (one per applying thread).
    fn ranges(&mut self, parts: usize) -> Vec<ShardRange<'_>> {
        let per_part = self.shards.len().div_ceil(parts);
        let (next_incarnation, chunk_bytes) = (self.next_incarnation, self.chunk_bytes);
        (0_u64..)
            .zip(self.shards.chunks_mut(per_part))
            .map(|(part, shards)| ShardRange {
                first: usize::try_from(part).unwrap_or(0) * per_part,
                shards,
                next_incarnation: next_incarnation + part,
                step: parts as u64,
                chunk_bytes,
            })
            .collect()
    }
}

impl ShardRange<'_> {
    /// Applies, in log order, the checked records of a window that belong to its shards;
    /// returns the position of the first record that contradicts the log, and why.
    fn apply(
        &mut self,
        window: &[u8],
        pending: &[PendingRecord],
        segment: u32,
        segment_version: u32,
    ) -> Result<(), (u64, String)> {
        for record in pending {
            let Some(shard) = record
                .shard
                .checked_sub(self.first)
                .and_then(|index| self.shards.get_mut(index))
            else {
                continue;
            };
            let bytes = &window[record.window_start..record.window_start + record.bytes];
            let outcome = format::decode_record(&bytes[RECORD_HEADER_BYTES..])
                .map_err(|reason| Problem::Inconsistent(reason.to_string()))
                .and_then(|decoded| {
                    apply_record(
                        shard,
                        decoded,
                        (segment, record),
                        segment_version,
                        (&mut self.next_incarnation, self.step),
                        self.chunk_bytes,
                    )
                });
            if let Err(Problem::Inconsistent(reason) | Problem::Damaged(reason)) = outcome {
                return Err((u64::from(record.position), reason));
            }
        }
        Ok(())
    }
}

impl ScanState {
    /// Checks every record of one segment, handing them to `flush` window by window; returns
    /// where the valid records end.
    #[allow(
        clippy::too_many_arguments,
        reason = "the segment, where to report and where to send records"
    )]
    fn scan(
        &mut self,
        segment: u32,
        name: &str,
        file: &dyn StorageFile,
        length: u64,
        last: bool,
        report: &mut OpenReport,
        flush: &mut Flush<'_>,
    ) -> Result<u64, OpenError> {
        let mut scanner = Scanner::new(file, length);
        let mut position = SEGMENT_HEADER_BYTES;
        let mut pending = Vec::new();
        let inconsistent = |(position, reason): (u64, String)| OpenError::Corrupt {
            file: name.to_string(),
            position,
            reason,
        };
        while position < length {
            let problem =
                match self.next_record(&mut scanner, segment, position, &mut pending, flush) {
                    Ok(record_bytes) => {
                        report.records += 1;
                        position += record_bytes;
                        continue;
                    }
                    Err((_, Problem::Damaged(problem))) => problem,
                    Err((position, Problem::Inconsistent(reason))) => {
                        // The record passed its checksum: this is not a torn write, and cutting
                        // here could drop acknowledged data. Refuse instead.
                        return Err(inconsistent((position, reason)));
                    }
                };
            if !last {
                return Err(OpenError::Corrupt {
                    file: name.to_string(),
                    position,
                    reason: problem,
                });
            }
            // The records before the damage are good: apply them, then cut.
            scanner
                .flush_window(&mut pending, flush)
                .map_err(inconsistent)?;
            report.truncated.push(TruncatedTail {
                file: name.to_string(),
                position,
                bytes_dropped: length - position,
                reason: problem,
            });
            return Ok(position);
        }
        scanner
            .flush_window(&mut pending, flush)
            .map_err(inconsistent)?;
        Ok(position)
    }

    /// Checks the record at `position` and queues it in `pending` (flushing the pending ones
    /// first if the record needs the window moved); returns its length, or what is wrong and
    /// where.
    fn next_record(
        &mut self,
        scanner: &mut Scanner<'_>,
        segment: u32,
        position: u64,
        pending: &mut Vec<PendingRecord>,
        flush: &mut Flush<'_>,
    ) -> Result<u64, (u64, Problem)> {
        let damaged = |reason: String| (position, Problem::Damaged(reason));
        let mut flush_window = |scanner: &mut Scanner<'_>, pending: &mut Vec<PendingRecord>| {
            scanner
                .flush_window(pending, flush)
                .map_err(|(at, reason)| (at, Problem::Inconsistent(reason)))
        };
        let left = scanner.length - position;
        if left < RECORD_HEADER_BYTES as u64 {
            return Err(damaged(format!(
                "record header cut short ({left} bytes left)"
            )));
        }
        if !scanner.contains(position, RECORD_HEADER_BYTES) {
            flush_window(scanner, pending)?;
        }
        let header = scanner
            .bytes(position, RECORD_HEADER_BYTES)
            .map_err(|error| damaged(error.to_string()))?;
        let body_bytes = usize::try_from(format::read_u32(header, 4)).unwrap_or(usize::MAX);
        if body_bytes == 0 || body_bytes > RECORD_BODY_BYTES_MAX {
            return Err(damaged(format!("record length {body_bytes} out of bounds")));
        }
        let record_bytes = (RECORD_HEADER_BYTES + body_bytes) as u64;
        if record_bytes > left {
            return Err(damaged(format!(
                "record of {record_bytes} bytes runs past the end of the file"
            )));
        }
        let bytes = usize::try_from(record_bytes).unwrap_or(usize::MAX);
        if !scanner.contains(position, bytes) {
            flush_window(scanner, pending)?;
        }
        let record = scanner
            .bytes(position, bytes)
            .map_err(|error| damaged(error.to_string()))?;
        if format::is_log_record(record) && self.floor.covers(segment, position) {
            // Its messages are in chunks (FORMAT.md, floor record): not needed, not decoded;
            // checked still, so that a damaged length is caught where it is.
            if !format::checksum_matches(record) {
                return Err(damaged("record checksum mismatch".to_string()));
            }
            self.log_records_skipped += 1;
            return Ok(record_bytes);
        }
        let decoded =
            format::decode_checked(record).map_err(|reason| damaged(reason.to_string()))?;
        let too_new = |what: &str, version: u32| {
            Err((
                position,
                Problem::Inconsistent(format!(
                    "{what} record in a segment of format version {} (first in {version})",
                    self.segment_version
                )),
            ))
        };
        let name = match &decoded {
            Record::Chunk(chunk) | Record::Log(chunk) => chunk.name,
            Record::Trim { name, .. } | Record::Delete { name } => name,
            Record::Floor(_) if self.segment_version < FLOOR_VERSION => {
                return too_new("floor", FLOOR_VERSION);
            }
            // Used before the scan (`find_floor`).
            Record::Floor(_) => return Ok(record_bytes),
            Record::LogBatch(_) if self.segment_version < LOG_BATCH_VERSION => {
                return too_new("log batch", LOG_BATCH_VERSION);
            }
            // Routed by its first run's queue; the other shards it names are found below.
            Record::LogBatch(batch) => batch.runs().next().map_or(&[][..], |run| run.name),
        };
        let shard = crate::store::shard_of(self.hasher, name);
        if matches!(decoded, Record::Chunk(_)) {
            *self.chunk_records.entry(segment).or_default() += 1;
        }
        let record_position = u32::try_from(position).map_err(|_| {
            (
                position,
                Problem::Inconsistent("record position past 4 GiB".to_string()),
            )
        })?;
        // Other lock shards named by a log batch. The writer puts in one record only runs of
        // one shard's queues (its log), but the format allows any: then each shard named gets
        // the record, applying only its own runs.
        let mut others: Vec<usize> = Vec::new();
        if let Record::LogBatch(batch) = &decoded {
            for run in batch.runs().skip(1) {
                let other = crate::store::shard_of(self.hasher, run.name);
                if other != shard && !others.contains(&other) {
                    others.push(other);
                }
            }
        }
        let record = PendingRecord {
            window_start: usize::try_from(position - scanner.window_start).unwrap_or(usize::MAX),
            bytes,
            position: record_position,
            shard,
            mixed: !others.is_empty(),
        };
        for other in others {
            pending.push(PendingRecord {
                shard: other,
                ..record
            });
        }
        pending.push(record);
        Ok(record_bytes)
    }
}

/// A checked record waiting in the scanner's window to be applied.
struct PendingRecord {
    /// Where the record starts in the window.
    window_start: usize,
    /// Record bytes, header included.
    bytes: usize,
    /// Where the record starts in its segment.
    position: u32,
    /// Its queue's lock shard.
    shard: usize,
    /// A log batch record with runs of more than one lock shard (pushed once per shard):
    /// only the runs of `shard` are applied.
    mixed: bool,
}

/// Applies one checked record to the queues of its shard being rebuilt.
fn apply_record(
    shard: &mut RecoveringMap,
    record: Record<'_>,
    (segment, at): (u32, &PendingRecord),
    segment_version: u32,
    (next_incarnation, step): (&mut u64, u64),
    chunk_bytes: usize,
) -> Result<(), Problem> {
    let (position, record_bytes) = (at.position, at.bytes);
    let mut new_queue = |name: &[u8], trimmed_to: u64| {
        let name: Arc<[u8]> = Arc::from(name);
        let queue = Recovering::new(name.clone(), *next_incarnation, trimmed_to);
        *next_incarnation += step;
        (name, queue)
    };
    // Record bodies are at most 2^30 bytes (checked when scanned), so the size fits in u32.
    let record_bytes = u32::try_from(record_bytes).unwrap_or(u32::MAX);
    match record {
        Record::Chunk(chunk) => {
            let entry = ChunkEntry {
                first_offset: chunk.first_offset,
                segment,
                position,
            };
            if let Some(queue) = shard.get_mut(chunk.name) {
                return queue.add_chunk(&chunk, entry, record_bytes);
            }
            let (name, mut queue) = new_queue(chunk.name, 0);
            queue.add_chunk(&chunk, entry, record_bytes)?;
            shard.insert(name, queue);
        }
        Record::Trim {
            name,
            first_retained_offset,
        } => {
            if let Some(queue) = shard.get_mut(name) {
                queue.trim(first_retained_offset, segment);
                return Ok(());
            }
            let (name, mut queue) = new_queue(name, first_retained_offset);
            queue.trim(first_retained_offset, segment);
            shard.insert(name, queue);
        }
        Record::Delete { name } => {
            shard.remove(name);
        }
        Record::Log(_) if segment_version < 2 => {
            return Err(Problem::Inconsistent(
                "log record in a segment of format version 1".to_string(),
            ));
        }
        // Never queued: handled in `next_record`.
        Record::Floor(_) => {}
        Record::Log(log) => {
            let run = (log.name, log.first_offset, log.count);
            replay_log(shard, &mut new_queue, run, log.messages(), chunk_bytes)?;
        }
        Record::LogBatch(batch) => {
            let hasher = at.mixed.then(crate::store::shard_hasher);
            for run in batch.runs() {
                if hasher.is_some_and(|hasher| crate::store::shard_of(hasher, run.name) != at.shard)
                {
                    continue;
                }
                let messages = run.messages();
                let run = (run.name, run.first_offset, run.count);
                replay_log(shard, &mut new_queue, run, messages, chunk_bytes)?;
            }
        }
    }
    Ok(())
}

/// Replays a log record or log batch run into its queue, created if unknown.
fn replay_log<'a>(
    shard: &mut RecoveringMap,
    new_queue: &mut impl FnMut(&[u8], u64) -> (Arc<[u8]>, Recovering),
    run: (&[u8], u64, u32),
    messages: impl Iterator<Item = &'a [u8]>,
    chunk_bytes: usize,
) -> Result<(), Problem> {
    if let Some(queue) = shard.get_mut(run.0) {
        return queue.add_log(run, messages, chunk_bytes);
    }
    let (name, mut queue) = new_queue(run.0, 0);
    queue.add_log(run, messages, chunk_bytes)?;
    shard.insert(name, queue);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CrashMode, SimulatedDisk, Store};

    /// A queue after a recovery: name, offsets, chunk entries, buffered count and bytes.
    type Rebuilt = (Vec<u8>, u64, u64, Vec<ChunkEntry>, usize, Vec<u8>);

    /// Every queue after a recovery, sorted by name.
    fn queues(recovered: &Recovered) -> Vec<Rebuilt> {
        let mut queues: Vec<Rebuilt> = recovered
            .shards
            .iter()
            .flat_map(|shard| shard.queues.values())
            .map(|state| {
                (
                    state.name.to_vec(),
                    state.first_offset,
                    state.next_offset,
                    state.chunks.iter().collect(),
                    state.buffer.as_ref().map_or(0, |buffer| buffer.count),
                    state
                        .buffer
                        .as_ref()
                        .map_or_else(Vec::new, |buffer| buffer.bytes().to_vec()),
                )
            })
            .collect();
        queues.sort_by(|one, other| one.0.cmp(&other.0));
        queues
    }

    #[test]
    fn given_a_log_batch_naming_queues_of_many_shards_when_recovering_should_replay_every_run() {
        // The writer never mixes lock shards in one record; the format allows it.
        let mut bytes = format::encode_segment_header(1).to_vec();
        format::encode_floor(&mut bytes, format::LogFloor::default());
        let mut open = None;
        let names: Vec<Vec<u8>> = (0..40)
            .map(|index| format!("queue-{index}").into_bytes())
            .collect();
        for (index, name) in names.iter().enumerate() {
            let first = format!("first-{index}");
            format::append_log_run(&mut bytes, &mut open, name, 0, 1, &[first.as_bytes()]);
        }
        for name in &names {
            format::append_log_run(&mut bytes, &mut open, name, 1, 1, &[b"second", b"third"]);
        }
        format::seal_log_batch(&mut bytes, open.unwrap());
        let hasher = crate::store::shard_hasher();
        let shards: std::collections::HashSet<usize> = names
            .iter()
            .map(|name| crate::store::shard_of(hasher, name))
            .collect();
        assert!(shards.len() > 10, "runs of many shards in one record");
        let disk = SimulatedDisk::new();
        disk.put_file(&format::segment_file_name(1), &bytes);
        let (store, report) =
            Store::open_with_storage(Arc::new(disk), StoreOptions::default()).unwrap();
        assert!(report.truncated.is_empty(), "{report:?}");
        assert_eq!((report.queues, report.messages), (40, 120));
        for (index, name) in names.iter().enumerate() {
            let batch = store.read(name, 0, 10, 1 << 20).unwrap();
            let messages: Vec<&[u8]> = batch.iter().collect();
            let first = format!("first-{index}");
            assert_eq!(messages, vec![first.as_bytes(), b"second", b"third"]);
        }
    }

    #[test]
    fn given_a_crashed_store_when_recovering_on_one_thread_or_three_then_the_queues_match() {
        let options = StoreOptions {
            segment_bytes_max: 16 << 10,
            chunk_bytes: 64,
            buffer_budget_bytes: 32 << 10,
            message_bytes_max: 1024,
            ..StoreOptions::default()
        };
        let disk = SimulatedDisk::new();
        let (store, _) = Store::open_with_storage(Arc::new(disk.clone()), options.clone()).unwrap();
        for index in 0..6_000_u32 {
            let queue = format!("queue-{}", index % 97);
            store
                .append(queue.as_bytes(), &index.to_le_bytes())
                .unwrap();
            if index % 1_500 == 0 {
                store.delete_queue(b"queue-5").unwrap();
            }
        }
        let survivor = disk.crash(CrashMode::DropUnsynced, 1);
        drop(store);
        let one = recover_on(&survivor.crash(CrashMode::DropUnsynced, 2), &options, false);
        let three = recover_on(&survivor.crash(CrashMode::DropUnsynced, 3), &options, true);
        let (one, three) = (one.unwrap(), three.unwrap());
        assert_eq!(one.report.messages, three.report.messages);
        assert_eq!(
            one.report.log_records_skipped,
            three.report.log_records_skipped
        );
        assert_eq!(queues(&one), queues(&three));
        assert_eq!(queues(&one).len(), 97);
        // Both paths had work: log records skipped before the floor, tails replayed after it.
        assert!(one.report.log_records_skipped > 0, "{:?}", one.report);
        assert!(queues(&one).iter().any(|queue| queue.4 > 0));
        // Incarnations are unique on both paths.
        for recovered in [&one, &three] {
            let mut seen: Vec<u64> = recovered
                .shards
                .iter()
                .flat_map(|shard| shard.queues.values().map(|state| state.incarnation))
                .collect();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), 97);
            assert!(
                seen.iter()
                    .all(|incarnation| *incarnation < recovered.next_incarnation)
            );
        }
    }
}
