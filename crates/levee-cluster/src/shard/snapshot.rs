//! A shard's data as one stream of bytes, and back: what a shard snapshot carries
//! (docs/CLUSTER.md, "Snapshots"), and [`SnapshotFile`], the file openraft sends and
//! receives it in.
//!
//! [`write_shard`] writes every queue of one shard that the node's store holds (see
//! [`shard_of_stored`]: plain queues and partitions, groups' commit, retry, dead-letter and
//! redrive queues, the shard's producer runs, delete counter and delay slots), each with its
//! first and next offsets and its messages, then the delay wheel's marks and cut-short slot.
//! [`install_shard`] replaces the shard's queues in another store with them: every queue of
//! the shard there is deleted, and each one written is created at its first offset
//! ([`Store::create_queue_at`]) and given its messages, so it holds every message at the
//! writer's offset. Queues of other shards and node-local ones are left alone. Consumers'
//! positions on the shard's queues (kept in each node's position logs) travel in the stream
//! too, and are handed to the installer's callback.
//!
//! The bytes: frames of a 4-byte little-endian length, a postcard [`Frame`], and its CRC32C
//! (4 bytes, little-endian); every frame is checked when read.

use std::future::Future;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::task::{Context, Poll};

use levee_broker::names::{
    COMMIT_PREFIX, DEAD_LETTER_PREFIX, DELAY_PREFIX, PARTITION_PREFIX, PRODUCER_PREFIX,
    REDRIVEN_PREFIX, RETRY_PREFIX, SHARD_DELETES_PREFIX, is_reserved, routing_name,
};
use levee_store::Store;
use serde::{Deserialize, Serialize};

use crate::shard::{ConsumerPosition, ShardId};

/// The layout's version, in the first frame.
const VERSION: u32 = 2;
/// Consumers' positions one frame carries at most.
const FRAME_POSITIONS_MAX: usize = 10_000;
/// Messages one frame carries at most ...
const FRAME_MESSAGES_MAX: usize = 1_000;
/// ... and bytes (past its first message).
const FRAME_BYTES_MAX: usize = 4 << 20;
/// Largest frame a reader takes (a frame of [`FRAME_BYTES_MAX`] and one message of the
/// largest size the store may take, with room to spare).
const FRAME_READ_BYTES_MAX: usize = 64 << 20;

/// One frame of the stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum Frame {
    /// First: the layout's version, the shard and the snapshot's id (openraft's).
    Start {
        version: u32,
        shard: ShardId,
        snapshot_id: String,
    },
    /// A queue: its name and offsets; its messages follow in [`Frame::Messages`].
    Queue {
        name: Vec<u8>,
        first_offset: u64,
        next_offset: u64,
    },
    /// Messages of the last [`Frame::Queue`], in offset order.
    Messages(Vec<Vec<u8>>),
    /// Some of one consumer's positions on the shard's queues (after every queue).
    Positions {
        consumer: String,
        positions: Vec<ConsumerPosition>,
    },
    /// Last: the delay wheel's marks and the slot a delivery cut short.
    End {
        delay_marks: (u64, u64),
        delay_partial: Option<(Vec<u8>, u64)>,
    },
}

/// Why a shard's stream could not be written or installed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Reading or writing the stream.
    #[error("the shard's snapshot stream: {0}")]
    Io(#[from] std::io::Error),
    /// The node's store.
    #[error("the store: {0}")]
    Store(String),
    /// The bytes are not a shard's snapshot (damaged, cut short, another layout).
    #[error("not a valid shard snapshot: {0}")]
    Invalid(String),
    /// The shard changed under a stream written after its capture: capture it again.
    #[error("the shard changed while its snapshot was written: {0}")]
    Changed(String),
}

/// What the stream says besides the queues: the delay wheel's marks and cut-short slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardTail {
    /// `DelayWheel::taken_below`.
    pub delay_marks: (u64, u64),
    /// The slot a delivery cut short, and where the next one goes on.
    pub delay_partial: Option<(Vec<u8>, u64)>,
}

/// The shard a queue of the node's store belongs to among `shards`, or `None` for a queue
/// that is the node's own (consumers' position logs, the node's own delay slots, any other
/// server-owned queue not placed by a shard).
pub fn shard_of_stored(queue: &[u8], shards: u32) -> Option<ShardId> {
    let embedded = |rest: &[u8]| -> Option<ShardId> {
        Some(u32::from_be_bytes(rest.get(..4)?.try_into().ok()?))
    };
    if let Some(rest) = queue.strip_prefix(PRODUCER_PREFIX) {
        return embedded(rest);
    }
    if let Some(rest) = queue.strip_prefix(SHARD_DELETES_PREFIX) {
        return embedded(rest);
    }
    if let Some(rest) = queue.strip_prefix(DELAY_PREFIX) {
        let hex = rest.strip_prefix(b"s")?.get(..8)?;
        return u32::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok();
    }
    let placed_by_topic = [
        PARTITION_PREFIX,
        COMMIT_PREFIX,
        RETRY_PREFIX,
        DEAD_LETTER_PREFIX,
        REDRIVEN_PREFIX,
    ];
    if placed_by_topic
        .iter()
        .any(|prefix| queue.starts_with(prefix))
        || !is_reserved(queue)
    {
        return Some(levee_proto::shards::shard_of_bytes(
            routing_name(queue),
            shards,
        ));
    }
    None
}

/// Every queue of `shard` (among `shards`) in `store`, sorted by name.
fn shard_queues(store: &Store, shard: ShardId, shards: u32) -> Vec<Vec<u8>> {
    let mut queues = Vec::new();
    store.for_each_queue_with_prefix(b"", |name| {
        if shard_of_stored(name, shards) == Some(shard) {
            queues.push(name.to_vec());
        }
    });
    queues.sort();
    queues
}

fn write_frame(out: &mut impl Write, frame: &Frame) -> Result<(), SnapshotError> {
    let body =
        postcard::to_allocvec(frame).map_err(|error| SnapshotError::Invalid(error.to_string()))?;
    let length = u32::try_from(body.len())
        .map_err(|_| SnapshotError::Invalid(format!("a frame of {} bytes", body.len())))?;
    out.write_all(&length.to_le_bytes())?;
    out.write_all(&body)?;
    out.write_all(&crc32c::crc32c(&body).to_le_bytes())?;
    Ok(())
}

fn read_frame(input: &mut impl Read) -> Result<Frame, SnapshotError> {
    let mut word = [0_u8; 4];
    input.read_exact(&mut word)?;
    let length = u32::from_le_bytes(word) as usize;
    if length > FRAME_READ_BYTES_MAX {
        return Err(SnapshotError::Invalid(format!(
            "a frame of {length} bytes (at most {FRAME_READ_BYTES_MAX})"
        )));
    }
    let mut body = vec![0_u8; length];
    input.read_exact(&mut body)?;
    input.read_exact(&mut word)?;
    if crc32c::crc32c(&body) != u32::from_le_bytes(word) {
        return Err(SnapshotError::Invalid(
            "a frame's checksum differs".to_owned(),
        ));
    }
    postcard::from_bytes(&body).map_err(|error| SnapshotError::Invalid(error.to_string()))
}

/// Which shard a stream holds, among how many, and the snapshot it is.
#[derive(Debug, Clone, Copy)]
pub struct StreamOf<'a> {
    /// The shard.
    pub shard: ShardId,
    /// The cluster's shards.
    pub shards: u32,
    /// openraft's id of the snapshot.
    pub snapshot_id: &'a str,
}

/// One queue of a shard as a capture found it: its name and offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CapturedQueue {
    /// The queue's name.
    pub name: Vec<u8>,
    /// Its first offset then.
    pub first_offset: u64,
    /// Its next offset then: the stream carries the messages below it.
    pub next_offset: u64,
}

/// A shard as it stood at one applied entry, cheap to take (offsets and positions, no
/// messages): what [`write_shard`] streams.
#[derive(Debug, Clone)]
pub struct Captured {
    /// Every queue of the shard, sorted by name.
    pub queues: Vec<CapturedQueue>,
    /// Every consumer's positions on them.
    pub positions: Vec<(String, Vec<ConsumerPosition>)>,
    /// The delay wheel's marks and cut-short slot.
    pub tail: ShardTail,
}

/// Captures the shard `of` names in `store` with `positions` and `tail` (the caller holds the
/// shard still meanwhile).
///
/// # Errors
/// Reading the store.
pub fn capture(
    store: &Store,
    (shard, shards): (ShardId, u32),
    positions: Vec<(String, Vec<ConsumerPosition>)>,
    tail: ShardTail,
) -> Result<Captured, SnapshotError> {
    let mut queues = Vec::new();
    for name in shard_queues(store, shard, shards) {
        if let Some(info) = store
            .queue_info(&name)
            .map_err(|error| SnapshotError::Store(error.to_string()))?
        {
            queues.push(CapturedQueue {
                name,
                first_offset: info.first_offset,
                next_offset: info.next_offset,
            });
        }
    }
    Ok(Captured {
        queues,
        positions,
        tail,
    })
}

/// Writes the shard `captured` holds to `out`: [`write_start`], [`write_queues`] of every
/// queue, [`write_end`].
///
/// # Errors
/// As theirs.
pub fn write_shard(
    store: &Store,
    of: StreamOf<'_>,
    captured: &Captured,
    still: &dyn Fn() -> bool,
    out: &mut impl Write,
) -> Result<(), SnapshotError> {
    write_start(of, out)?;
    write_queues(store, &captured.queues, still, out)?;
    write_end(captured, out)
}

/// The stream's first frame.
///
/// # Errors
/// Writing to `out`.
pub fn write_start(of: StreamOf<'_>, out: &mut impl Write) -> Result<(), SnapshotError> {
    write_frame(
        out,
        &Frame::Start {
            version: VERSION,
            shard: of.shard,
            snapshot_id: of.snapshot_id.to_owned(),
        },
    )
}

/// Writes `queues` (captured): each one's messages below its captured next offset, read from
/// `store` now (appends since the capture are left out; a queue trimmed since starts at its
/// new first offset, as on a replica that trimmed it sooner). `still()` is asked before each
/// queue whether the shard is still as captured.
///
/// # Errors
/// Writing to `out`, reading the store, a queue that no longer holds its captured messages
/// (deleted since), or `still` saying no ([`SnapshotError::Changed`]).
pub fn write_queues(
    store: &Store,
    queues: &[CapturedQueue],
    still: &dyn Fn() -> bool,
    out: &mut impl Write,
) -> Result<(), SnapshotError> {
    for queue in queues {
        if !still() {
            return Err(SnapshotError::Changed(
                "the shard changed under the stream".to_owned(),
            ));
        }
        write_queue(store, queue, out)?;
    }
    Ok(())
}

/// The consumers' positions and the tail `captured` holds, and the end of the stream.
///
/// # Errors
/// Writing to `out`.
pub fn write_end(captured: &Captured, out: &mut impl Write) -> Result<(), SnapshotError> {
    for (consumer, held) in &captured.positions {
        for part in held.chunks(FRAME_POSITIONS_MAX) {
            write_frame(
                out,
                &Frame::Positions {
                    consumer: consumer.clone(),
                    positions: part.to_vec(),
                },
            )?;
        }
    }
    write_frame(
        out,
        &Frame::End {
            delay_marks: captured.tail.delay_marks,
            delay_partial: captured.tail.delay_partial.clone(),
        },
    )?;
    out.flush()?;
    Ok(())
}

/// Writes one captured queue's frames.
fn write_queue(
    store: &Store,
    queue: &CapturedQueue,
    out: &mut impl Write,
) -> Result<(), SnapshotError> {
    let changed = |offset: u64| {
        SnapshotError::Changed(format!(
            "queue '{}' no longer holds offset {offset} (deleted since the capture)",
            String::from_utf8_lossy(&queue.name)
        ))
    };
    let mut offset = queue.first_offset;
    let mut started = false;
    while offset < queue.next_offset {
        let batch = store
            .read(&queue.name, offset, FRAME_MESSAGES_MAX, FRAME_BYTES_MAX)
            .map_err(|error| SnapshotError::Store(error.to_string()))?;
        if batch.is_empty() || (started && batch.first_offset != offset) {
            return Err(changed(offset));
        }
        if batch.first_offset >= queue.next_offset {
            // Trimmed past every captured message since.
            offset = queue.next_offset;
            break;
        }
        if !started {
            // From its first message now (trimmed since the capture, maybe).
            write_frame(
                out,
                &Frame::Queue {
                    name: queue.name.clone(),
                    first_offset: batch.first_offset,
                    next_offset: queue.next_offset,
                },
            )?;
            started = true;
        }
        let wanted = usize::try_from(queue.next_offset - batch.first_offset).unwrap_or(usize::MAX);
        let messages: Vec<Vec<u8>> = batch.iter().take(wanted).map(<[u8]>::to_vec).collect();
        offset = batch.first_offset + messages.len() as u64;
        write_frame(out, &Frame::Messages(messages))?;
    }
    if !started {
        write_frame(
            out,
            &Frame::Queue {
                name: queue.name.clone(),
                first_offset: offset,
                next_offset: queue.next_offset,
            },
        )?;
    }
    Ok(())
}

/// What an installer does with each consumer's positions in a stream.
pub type OnPositions<'a> = dyn FnMut(&str, &[ConsumerPosition]) -> Result<(), String> + 'a;

/// Replaces the queues of the shard in `store` with those `input` holds (see the module's
/// text), durably; hands each consumer's positions to `on_positions`; returns what the stream
/// says besides.
///
/// # Errors
/// A stream that is not a whole snapshot `of` (checked frame by frame: the queues already
/// replaced stay so; install again), a store failure, or one of `on_positions`.
pub fn install_shard(
    store: &Store,
    of: StreamOf<'_>,
    input: &mut impl Read,
    on_positions: &mut OnPositions<'_>,
) -> Result<ShardTail, SnapshotError> {
    let StreamOf { shard, shards, .. } = of;
    let store_error = |error: &dyn std::fmt::Display| SnapshotError::Store(error.to_string());
    match read_frame(input)? {
        Frame::Start {
            version,
            shard: its,
            snapshot_id,
        } if version == VERSION && its == shard && snapshot_id == of.snapshot_id => {}
        other => {
            return Err(SnapshotError::Invalid(format!(
                "it starts with {other:?}, not shard {shard}'s version {VERSION} start of \
                 snapshot {}",
                of.snapshot_id
            )));
        }
    }
    for name in shard_queues(store, shard, shards) {
        store
            .delete_queue(&name)
            .map_err(|error| store_error(&error))?;
    }
    let mut current: Option<(Vec<u8>, u64)> = None;
    let mut last_ticket = None;
    let tail = loop {
        match read_frame(input)? {
            Frame::Start { .. } => {
                return Err(SnapshotError::Invalid("a second start".to_owned()));
            }
            Frame::Queue {
                name,
                first_offset,
                next_offset,
            } => {
                check_whole(current.as_ref(), store)?;
                if shard_of_stored(&name, shards) != Some(shard) {
                    return Err(SnapshotError::Invalid(format!(
                        "queue '{}' is not of shard {shard}",
                        String::from_utf8_lossy(&name)
                    )));
                }
                store
                    .create_queue_at(&name, first_offset)
                    .map_err(|error| store_error(&error))?;
                current = Some((name, next_offset));
            }
            Frame::Messages(messages) => {
                let Some((name, _)) = &current else {
                    return Err(SnapshotError::Invalid("messages before a queue".to_owned()));
                };
                let batch: Vec<(&[u8], &[u8])> = messages
                    .iter()
                    .map(|message| (name.as_slice(), message.as_slice()))
                    .collect();
                let (_, ticket) = store
                    .append_batch_deferred(&batch)
                    .map_err(|error| store_error(&error))?;
                last_ticket = Some(ticket);
            }
            Frame::Positions {
                consumer,
                positions,
            } => {
                check_whole(current.take().as_ref(), store)?;
                on_positions(&consumer, &positions).map_err(SnapshotError::Store)?;
            }
            Frame::End {
                delay_marks,
                delay_partial,
            } => {
                check_whole(current.as_ref(), store)?;
                break ShardTail {
                    delay_marks,
                    delay_partial,
                };
            }
        }
    };
    if let Some(ticket) = last_ticket {
        store
            .wait_durable(ticket)
            .map_err(|error| store_error(&error))?;
    }
    Ok(tail)
}

/// Whether the queue being installed got every message up to its next offset.
fn check_whole(current: Option<&(Vec<u8>, u64)>, store: &Store) -> Result<(), SnapshotError> {
    let Some((name, next_offset)) = current else {
        return Ok(());
    };
    let stored = crate::shard::plan::next_offset(store, name);
    if stored == *next_offset {
        Ok(())
    } else {
        Err(SnapshotError::Invalid(format!(
            "queue '{}' ends at {stored}, its snapshot said {next_offset}",
            String::from_utf8_lossy(name)
        )))
    }
}

/// What a snapshot being written says once it ends: the whole file's path, or why it failed.
pub type Written = Option<Result<PathBuf, String>>;

/// A shard snapshot's file, as openraft reads it to send it and writes the chunks it
/// receives into it; the path says where it lies, so an install can keep it. One still being
/// written ([`SnapshotFile::when_written`]) makes every read and seek wait until it is whole.
pub struct SnapshotFile {
    state: FileState,
    path: PathBuf,
    /// A seek asked for before the file was open.
    pending_seek: Option<std::io::SeekFrom>,
}

/// The wait for a file being written: the file opened, and its path.
type Opening = Pin<Box<dyn Future<Output = std::io::Result<(tokio::fs::File, PathBuf)>> + Send>>;

/// The file, or the wait for it.
enum FileState {
    Open(tokio::fs::File),
    Waiting(Opening),
}

impl std::fmt::Debug for SnapshotFile {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            FileState::Open(_) => "open",
            FileState::Waiting(_) => "being written",
        };
        write!(formatter, "SnapshotFile({}, {state})", self.path.display())
    }
}

impl SnapshotFile {
    fn opened(file: tokio::fs::File, path: &Path) -> Self {
        Self {
            state: FileState::Open(file),
            path: path.to_owned(),
            pending_seek: None,
        }
    }

    /// `path`, opened to read.
    ///
    /// # Errors
    /// Opening it.
    pub async fn open(path: &Path) -> std::io::Result<Self> {
        Ok(Self::opened(tokio::fs::File::open(path).await?, path))
    }

    /// A new empty file at `path` (replacing one there), to write.
    ///
    /// # Errors
    /// Creating it.
    pub async fn create(path: &Path) -> std::io::Result<Self> {
        Ok(Self::opened(tokio::fs::File::create(path).await?, path))
    }

    /// The file a writer is writing, opened to read once `written` says it is whole: reads
    /// and seeks wait until then, and fail if the write did. The first read or seek calls
    /// `start` first (a writer may wait for that before it writes).
    pub fn when_written(
        start: impl FnOnce() + Send + 'static,
        mut written: tokio::sync::watch::Receiver<Written>,
    ) -> Self {
        let opening = async move {
            start();
            let outcome = written
                .wait_for(Option::is_some)
                .await
                .map_err(|_| std::io::Error::other("the snapshot's writer stopped"))?
                .clone();
            match outcome {
                Some(Ok(path)) => Ok((tokio::fs::File::open(&path).await?, path)),
                Some(Err(why)) => Err(std::io::Error::other(why)),
                None => Err(std::io::Error::other("the snapshot's writer stopped")),
            }
        };
        Self {
            state: FileState::Waiting(Box::pin(opening)),
            path: PathBuf::new(),
            pending_seek: None,
        }
    }

    /// Where the file lies (known once it is open).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits until what was written is on disk.
    ///
    /// # Errors
    /// The fsync, or a file still being written by another.
    pub async fn sync(&mut self) -> std::io::Result<()> {
        use tokio::io::AsyncWriteExt as _;
        let FileState::Open(file) = &mut self.state else {
            return Err(std::io::Error::other("the snapshot file is being written"));
        };
        file.flush().await?;
        file.sync_all().await
    }

    /// The file, once open.
    fn poll_file(
        &mut self,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<&mut tokio::fs::File>> {
        if let FileState::Waiting(opening) = &mut self.state {
            match opening.as_mut().poll(context) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Ready(Ok((file, path))) => {
                    self.state = FileState::Open(file);
                    self.path = path;
                }
            }
        }
        match &mut self.state {
            FileState::Open(file) => Poll::Ready(Ok(file)),
            FileState::Waiting(_) => Poll::Pending,
        }
    }
}

impl SnapshotFile {
    /// `operation` on the file once it is open.
    fn on_file<T>(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        operation: impl FnOnce(Pin<&mut tokio::fs::File>, &mut Context<'_>) -> Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        match self.get_mut().poll_file(context) {
            Poll::Ready(Ok(file)) => operation(Pin::new(file), context),
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl tokio::io::AsyncRead for SnapshotFile {
    fn poll_read(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.on_file(context, |file, context| file.poll_read(context, buffer))
    }
}

impl tokio::io::AsyncWrite for SnapshotFile {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.on_file(context, |file, context| file.poll_write(context, buffer))
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.on_file(context, tokio::io::AsyncWrite::poll_flush)
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.on_file(context, tokio::io::AsyncWrite::poll_shutdown)
    }
}

impl tokio::io::AsyncSeek for SnapshotFile {
    fn start_seek(self: Pin<&mut Self>, position: std::io::SeekFrom) -> std::io::Result<()> {
        let this = self.get_mut();
        match &mut this.state {
            FileState::Open(file) => Pin::new(file).start_seek(position),
            FileState::Waiting(_) => {
                this.pending_seek = Some(position);
                Ok(())
            }
        }
    }

    fn poll_complete(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<std::io::Result<u64>> {
        let this = self.get_mut();
        let pending_seek = this.pending_seek;
        let file = match this.poll_file(context) {
            Poll::Ready(Ok(file)) => file,
            Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
            Poll::Pending => return Poll::Pending,
        };
        if let Some(position) = pending_seek {
            Pin::new(&mut *file).start_seek(position)?;
            this.pending_seek = None;
        }
        let FileState::Open(file) = &mut this.state else {
            return Poll::Pending;
        };
        Pin::new(file).poll_complete(context)
    }
}

#[cfg(test)]
mod tests {
    use levee_broker::delay::Slot;
    use levee_broker::names::{
        POSITION_LOG_PREFIX, commit_queue, dead_letter_queue, partition_queue, retry_queue,
    };
    use levee_proto::shards::shard_of_bytes;
    use levee_store::StoreOptions;

    use super::*;
    use crate::shard::plan::{deletes_queue, producer_queue};

    const SHARDS: u32 = 4;

    /// A queue that is the node's own: a consumer's position log.
    fn position_log_queue() -> Vec<u8> {
        [POSITION_LOG_PREFIX, b"app"].concat()
    }

    fn open(directory: &std::path::Path) -> Store {
        Store::open(directory, StoreOptions::default())
            .expect("a store")
            .0
    }

    /// A name starting with `tag` whose routing name falls in `shard`.
    fn name_in(shard: ShardId, tag: &str) -> String {
        (0..100_000)
            .map(|number| format!("{tag}-{number}"))
            .find(|name| shard_of_bytes(name.as_bytes(), SHARDS) == shard)
            .expect("a name")
    }

    /// A queue as a test compares it: name, first and next offsets, messages.
    type Copied = (Vec<u8>, u64, u64, Vec<Vec<u8>>);

    /// Every queue of `shard` in `store`.
    fn contents(store: &Store, shard: ShardId) -> Vec<Copied> {
        shard_queues(store, shard, SHARDS)
            .into_iter()
            .map(|name| {
                let info = store.queue_info(&name).unwrap().unwrap();
                let batch = store
                    .read(&name, info.first_offset, 10_000, usize::MAX)
                    .unwrap();
                let messages = batch.iter().map(<[u8]>::to_vec).collect();
                (name, info.first_offset, info.next_offset, messages)
            })
            .collect()
    }

    fn append(store: &Store, queue: &[u8], messages: &[&str]) {
        for message in messages {
            store.append(queue, message.as_bytes()).unwrap();
        }
    }

    #[test]
    fn given_queue_names_then_each_is_placed_in_its_shard_or_is_the_nodes_own() {
        let topic = name_in(2, "topic");
        let plain = name_in(3, "plain");
        assert_eq!(shard_of_stored(plain.as_bytes(), SHARDS), Some(3));
        for placed_by_topic in [
            partition_queue(&topic, 1),
            commit_queue("billing", &topic),
            retry_queue("billing", &topic, 1),
            dead_letter_queue("billing", &topic),
        ] {
            assert_eq!(shard_of_stored(&placed_by_topic, SHARDS), Some(2));
        }
        assert_eq!(shard_of_stored(&producer_queue(1, "p"), SHARDS), Some(1));
        assert_eq!(shard_of_stored(&deletes_queue(3), SHARDS), Some(3));
        assert_eq!(
            shard_of_stored(&Slot::Fine(9).shard_queue(2), SHARDS),
            Some(2)
        );
        assert_eq!(shard_of_stored(&Slot::Fine(9).queue(), SHARDS), None);
        assert_eq!(shard_of_stored(&position_log_queue(), SHARDS), None);
    }

    #[test]
    fn given_a_shard_of_every_kind_of_queue_when_installed_elsewhere_then_that_store_holds_it_exactly()
     {
        let (from, to) = (
            tempfile::tempdir().expect("a directory"),
            tempfile::tempdir().expect("a directory"),
        );
        let (source, target) = (open(from.path()), open(to.path()));
        let shard = 1;
        let topic = name_in(shard, "topic");
        let plain = name_in(shard, "plain");
        let imported = name_in(shard, "imported");
        append(&source, plain.as_bytes(), &["a", "b", "c"]);
        append(&source, &partition_queue(&topic, 0), &["p0"]);
        append(&source, &commit_queue("billing", &topic), &["commit"]);
        append(&source, &retry_queue("billing", &topic, 0), &["retry"]);
        append(&source, &producer_queue(shard, "p"), &["runs"]);
        append(&source, &deletes_queue(shard), &["", ""]);
        append(&source, &Slot::Fine(7).shard_queue(shard), &["entry"]);
        // A queue whose messages start past 0 (a replica's own import, or a trimmed queue).
        assert!(source.create_queue_at(imported.as_bytes(), 40).unwrap());
        append(&source, imported.as_bytes(), &["x", "y"]);
        // Another shard's, and the node's own: not in the stream.
        append(&source, name_in(2, "other").as_bytes(), &["elsewhere"]);
        append(&source, &position_log_queue(), &["mine"]);
        let tail = ShardTail {
            delay_marks: (12, 3),
            delay_partial: Some((Slot::Fine(7).shard_queue(shard), 0)),
        };
        let positions = vec![
            (
                "app".to_owned(),
                vec![ConsumerPosition {
                    queue: plain.clone().into_bytes().into(),
                    epoch: 1,
                    next: 2,
                }],
            ),
            (
                "many".to_owned(),
                (0..FRAME_POSITIONS_MAX as u64 + 5)
                    .map(|next| ConsumerPosition {
                        queue: format!("{plain}-{next}").into_bytes().into(),
                        epoch: 0,
                        next,
                    })
                    .collect(),
            ),
        ];
        let of = |shard| StreamOf {
            shard,
            shards: SHARDS,
            snapshot_id: "1-9-5",
        };
        let mut stream = Vec::new();
        let captured = capture(&source, (shard, SHARDS), positions.clone(), tail.clone()).unwrap();
        // Appended after the capture: not in the stream.
        append(&source, plain.as_bytes(), &["later"]);
        write_shard(&source, of(shard), &captured, &|| true, &mut stream).unwrap();
        let later = source.read(plain.as_bytes(), 3, 1, usize::MAX).unwrap();
        assert_eq!(later.iter().next(), Some(&b"later"[..]));
        source.delete_queue(plain.as_bytes()).unwrap();
        append(&source, plain.as_bytes(), &["a", "b", "c"]);
        // The target held an older state of the shard, another shard's queues, its own.
        append(&target, plain.as_bytes(), &["stale", "stale"]);
        append(&target, name_in(shard, "gone").as_bytes(), &["stale"]);
        append(&target, name_in(3, "kept").as_bytes(), &["kept"]);
        append(&target, &position_log_queue(), &["its own"]);
        let others_before = contents(&target, 3);
        let mut received: Vec<(String, Vec<ConsumerPosition>)> = Vec::new();
        let installed = install_shard(
            &target,
            of(shard),
            &mut stream.as_slice(),
            &mut |consumer, held| {
                match received.last_mut() {
                    Some((last, all)) if last == consumer => all.extend_from_slice(held),
                    _ => received.push((consumer.to_owned(), held.to_vec())),
                }
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(installed, tail);
        assert_eq!(received, positions);
        assert_eq!(contents(&target, shard), contents(&source, shard));
        assert_eq!(contents(&target, 1).len(), 8, "{:?}", contents(&target, 1));
        assert_eq!(contents(&target, 3), others_before);
        let own = target
            .read(&position_log_queue(), 0, 10, usize::MAX)
            .unwrap();
        assert_eq!(own.iter().next(), Some(&b"its own"[..]));
        // Appends go on at the source's offsets.
        assert_eq!(target.append(imported.as_bytes(), b"z").unwrap(), 42);
    }

    #[test]
    fn given_a_damaged_cut_or_another_snapshots_stream_when_installed_then_it_is_refused() {
        let (from, to) = (
            tempfile::tempdir().expect("a directory"),
            tempfile::tempdir().expect("a directory"),
        );
        let (source, target) = (open(from.path()), open(to.path()));
        let shard = 1;
        append(
            &source,
            name_in(shard, "plain").as_bytes(),
            &["a", "b", "c"],
        );
        let of = |shard| StreamOf {
            shard,
            shards: SHARDS,
            snapshot_id: "1-9-5",
        };
        let tail = ShardTail {
            delay_marks: (0, 0),
            delay_partial: None,
        };
        let mut stream = Vec::new();
        let captured = capture(&source, (shard, SHARDS), Vec::new(), tail).unwrap();
        write_shard(&source, of(shard), &captured, &|| true, &mut stream).unwrap();
        // A stream told the shard changed, and one whose queue was deleted since the capture,
        // stop.
        assert!(matches!(
            write_shard(&source, of(shard), &captured, &|| false, &mut Vec::new()),
            Err(SnapshotError::Changed(_))
        ));
        source
            .delete_queue(name_in(shard, "plain").as_bytes())
            .unwrap();
        assert!(matches!(
            write_shard(&source, of(shard), &captured, &|| true, &mut Vec::new()),
            Err(SnapshotError::Changed(_))
        ));
        let mut damaged = stream.clone();
        let middle = damaged.len() / 2;
        damaged[middle] ^= 0x40;
        let mut ignore = |_: &str, _: &[ConsumerPosition]| Ok(());
        assert!(matches!(
            install_shard(&target, of(shard), &mut damaged.as_slice(), &mut ignore),
            Err(SnapshotError::Invalid(_))
        ));
        assert!(matches!(
            install_shard(&target, of(2), &mut stream.as_slice(), &mut ignore),
            Err(SnapshotError::Invalid(_))
        ));
        let another = StreamOf {
            snapshot_id: "1-9-6",
            ..of(shard)
        };
        assert!(matches!(
            install_shard(&target, another, &mut stream.as_slice(), &mut ignore),
            Err(SnapshotError::Invalid(_))
        ));
        assert!(matches!(
            install_shard(
                &target,
                of(shard),
                &mut &stream[..stream.len() - 3],
                &mut ignore
            ),
            Err(SnapshotError::Io(_))
        ));
        assert!(install_shard(&target, of(shard), &mut stream.as_slice(), &mut ignore).is_ok());
    }
}
