//! The on-disk format, version 4: the segment file header and the six record kinds (chunk,
//! trim, delete, log, floor, log batch). Versions 1 (no log records), 2 (no floor records) and
//! 3 (no log batch records) are still read. Everything is little-endian;
//! docs/FORMAT.md describes it byte by byte.

/// Magic bytes at the start of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"LEVEEQS\0";
/// The format version this crate writes (and the newest it reads).
pub const FORMAT_VERSION: u32 = 4;
/// The oldest format version this crate reads: version 1 has no log records.
pub const FORMAT_VERSION_OLDEST_READ: u32 = 1;
/// Bytes in a segment file header.
pub const SEGMENT_HEADER_BYTES: u64 = 32;
/// Bytes before a record's body: crc32c (4) and body length (4).
pub const RECORD_HEADER_BYTES: usize = 8;
/// Fixed bytes at the start of a chunk body, before the queue name.
pub const CHUNK_FIXED_BYTES: usize = 24;
/// Fixed bytes at the start of a trim body, before the queue name.
pub const TRIM_FIXED_BYTES: usize = 16;
/// Fixed bytes at the start of a delete body, before the queue name.
pub const DELETE_FIXED_BYTES: usize = 4;
/// Fixed bytes at the start of a log batch body, before its first run.
pub const LOG_BATCH_FIXED_BYTES: usize = 16;
/// A log batch record takes no new run once its body is this long (a single run may make
/// it longer): bounds what one damaged record can take with it and what a reader of the
/// log holds at once.
pub const LOG_BATCH_BODY_TARGET: usize = 1 << 20;
/// Bytes a run of a log batch takes beyond its queue name and payload, at most: the name
/// length, the first offset and the count (varints, 10 bytes at most each) and, per
/// message, a length (a varint of a u32: 5 bytes at most) counted by [`log_run_bytes`].
const LOG_RUN_FIXED_BYTES_MAX: usize = 1 + 10 + 10;
/// Bytes of a floor body (it names no queue).
pub const FLOOR_BODY_BYTES: usize = 16;
/// Bytes of a floor record, header included.
pub const FLOOR_RECORD_BYTES: usize = RECORD_HEADER_BYTES + FLOOR_BODY_BYTES;
/// The largest record body the format allows (1 GiB); longer length fields are corruption.
pub const RECORD_BODY_BYTES_MAX: usize = 1 << 30;
/// Longest queue name, in bytes.
pub const QUEUE_NAME_BYTES_MAX: usize = 255;

const KIND_CHUNK: u8 = 1;
const KIND_TRIM: u8 = 2;
const KIND_DELETE: u8 = 3;
const KIND_LOG: u8 = 4;
const KIND_FLOOR: u8 = 5;
const KIND_LOG_BATCH: u8 = 6;

/// File name of the segment with this id.
pub fn segment_file_name(segment: u32) -> String {
    format!("segment-{segment:010}.lvq")
}

/// The segment id in a segment file name, or `None` for any other name.
pub fn parse_segment_file_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("segment-")?.strip_suffix(".lvq")?;
    if digits.len() != 10 || !digits.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Encodes the 32-byte header of segment `segment`.
pub fn encode_segment_header(segment: u32) -> [u8; 32] {
    let mut header = [0_u8; 32];
    header[0..8].copy_from_slice(&SEGMENT_MAGIC);
    header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&32_u32.to_le_bytes());
    header[16..24].copy_from_slice(&u64::from(segment).to_le_bytes());
    let crc = crc32c::crc32c(&header[0..28]);
    header[28..32].copy_from_slice(&crc.to_le_bytes());
    header
}

/// Why a segment header was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderProblem {
    /// The first 8 bytes are not [`SEGMENT_MAGIC`]; holds what was found.
    NotLevee([u8; 8]),
    /// A Levee segment of another format version.
    Version(u32),
    /// Magic and version are right but the checksum or another field is wrong.
    Damaged(&'static str),
}

/// Checks a segment header and returns the segment id it names.
pub fn decode_segment_header(header: &[u8; 32]) -> Result<u64, HeaderProblem> {
    let magic: [u8; 8] = slice_array(header, 0);
    if magic != SEGMENT_MAGIC {
        return Err(HeaderProblem::NotLevee(magic));
    }
    let version = read_u32(header, 8);
    if !(FORMAT_VERSION_OLDEST_READ..=FORMAT_VERSION).contains(&version) {
        return Err(HeaderProblem::Version(version));
    }
    if crc32c::crc32c(&header[0..28]) != read_u32(header, 28) {
        return Err(HeaderProblem::Damaged("header checksum mismatch"));
    }
    if read_u32(header, 12) != 32 {
        return Err(HeaderProblem::Damaged("header length is not 32"));
    }
    Ok(read_u64(header, 16))
}

/// Bytes of a chunk record (header included) holding messages of these lengths.
pub fn chunk_record_bytes(name_bytes: usize, message_count: usize, payload_bytes: usize) -> usize {
    RECORD_HEADER_BYTES + CHUNK_FIXED_BYTES + name_bytes + 4 * message_count + payload_bytes
}

/// Appends one chunk record to `out`. `lengths` are the message lengths and `payload` their
/// bytes, back to back.
pub fn encode_chunk(
    out: &mut Vec<u8>,
    name: &[u8],
    first_offset: u64,
    timestamp_ms: u64,
    lengths: &[u32],
    payload: &[u8],
) {
    let start = out.len();
    let body_bytes = CHUNK_FIXED_BYTES + name.len() + 4 * lengths.len() + payload.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&to_u32(body_bytes).to_le_bytes());
    out.push(KIND_CHUNK);
    out.push(name_length_byte(name));
    out.extend_from_slice(&[0; 2]);
    out.extend_from_slice(&to_u32(lengths.len()).to_le_bytes());
    out.extend_from_slice(&first_offset.to_le_bytes());
    out.extend_from_slice(&timestamp_ms.to_le_bytes());
    out.extend_from_slice(name);
    for length in lengths {
        out.extend_from_slice(&length.to_le_bytes());
    }
    out.extend_from_slice(payload);
    seal_record(out, start);
    debug_assert!(decode_record(&out[start + RECORD_HEADER_BYTES..]).is_ok());
}

/// Appends one chunk record of `count` messages framed as a write buffer holds them: each a
/// little-endian u32 length then its bytes, `payload_bytes` of message bytes in all. Produces
/// the same record as [`encode_chunk`].
pub fn encode_chunk_framed(
    out: &mut Vec<u8>,
    name: &[u8],
    first_offset: u64,
    timestamp_ms: u64,
    count: usize,
    payload_bytes: usize,
    framed: &[u8],
) {
    let start = out.len();
    let body_bytes = CHUNK_FIXED_BYTES + name.len() + 4 * count + payload_bytes;
    debug_assert_eq!(framed.len(), 4 * count + payload_bytes);
    out.reserve(RECORD_HEADER_BYTES + body_bytes);
    // The fixed part in one copy: crc (filled by seal_record), body length, kind, name
    // length, 2 zero bytes, count, first offset, timestamp.
    let mut fixed = [0_u8; RECORD_HEADER_BYTES + CHUNK_FIXED_BYTES];
    fixed[4..8].copy_from_slice(&to_u32(body_bytes).to_le_bytes());
    fixed[8] = KIND_CHUNK;
    fixed[9] = name_length_byte(name);
    fixed[12..16].copy_from_slice(&to_u32(count).to_le_bytes());
    fixed[16..24].copy_from_slice(&first_offset.to_le_bytes());
    fixed[24..32].copy_from_slice(&timestamp_ms.to_le_bytes());
    out.extend_from_slice(&fixed);
    out.extend_from_slice(name);
    let mut position = 0;
    for _ in 0..count {
        let length = &framed[position..position + 4];
        out.extend_from_slice(length);
        position += 4 + usize::try_from(read_u32(length, 0)).unwrap_or(usize::MAX);
    }
    let mut position = 0;
    for _ in 0..count {
        let length = usize::try_from(read_u32(framed, position)).unwrap_or(usize::MAX);
        out.extend_from_slice(&framed[position + 4..position + 4 + length]);
        position += 4 + length;
    }
    seal_record(out, start);
    debug_assert!(decode_record(&out[start + RECORD_HEADER_BYTES..]).is_ok());
}

/// A log batch record still open at the end of a buffer: more runs may be added until it is
/// sealed ([`seal_log_batch`]), which writes its length, run count and checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenLogBatch {
    /// Where the record starts in the buffer.
    start: usize,
    /// Runs in it so far.
    runs: u32,
}

impl OpenLogBatch {
    /// The same record after the bytes before it were copied to `base` in another buffer.
    #[must_use]
    pub fn rebased(self, base: usize) -> Self {
        Self {
            start: self.start + base,
            runs: self.runs,
        }
    }
}

/// Bytes a log batch run of `messages` to a queue named `name_bytes` long takes, at most,
/// plus a record header and fixed body in case it opens a new record: what an append reserves
/// of the buffer budget for it.
pub fn log_run_bytes_max(name_bytes: usize, messages: &[&[u8]]) -> usize {
    RECORD_HEADER_BYTES
        + LOG_BATCH_FIXED_BYTES
        + LOG_RUN_FIXED_BYTES_MAX
        + name_bytes
        + messages
            .iter()
            .map(|message| 5 + message.len())
            .sum::<usize>()
}

/// Appends one run (`messages` of queue `name` from offset `first_offset`) to the log batch
/// record open at the end of `out`, or opens one (stamped `timestamp_ms`) if none is open or
/// the open one reached [`LOG_BATCH_BODY_TARGET`] (sealing it first).
pub fn append_log_run(
    out: &mut Vec<u8>,
    open: &mut Option<OpenLogBatch>,
    name: &[u8],
    first_offset: u64,
    timestamp_ms: u64,
    messages: &[&[u8]],
) {
    let batch = match *open {
        Some(batch) if out.len() - batch.start < RECORD_HEADER_BYTES + LOG_BATCH_BODY_TARGET => {
            batch
        }
        _ => {
            if let Some(full) = open.take() {
                seal_log_batch(out, full);
            }
            let start = out.len();
            let mut fixed = [0_u8; RECORD_HEADER_BYTES + LOG_BATCH_FIXED_BYTES];
            fixed[8] = KIND_LOG_BATCH;
            fixed[16..24].copy_from_slice(&timestamp_ms.to_le_bytes());
            out.extend_from_slice(&fixed);
            OpenLogBatch { start, runs: 0 }
        }
    };
    out.push(name_length_byte(name));
    out.extend_from_slice(name);
    put_varint(out, first_offset);
    put_varint(out, messages.len() as u64);
    for message in messages {
        put_varint(out, message.len() as u64);
        out.extend_from_slice(message);
    }
    *open = Some(OpenLogBatch {
        start: batch.start,
        runs: batch.runs + 1,
    });
}

/// Seals the log batch record `open`, which runs to the end of `out`: writes its body length,
/// run count and checksum.
pub fn seal_log_batch(out: &mut [u8], open: OpenLogBatch) {
    let start = open.start;
    let body_bytes = out.len() - start - RECORD_HEADER_BYTES;
    out[start + 4..start + 8].copy_from_slice(&to_u32(body_bytes).to_le_bytes());
    out[start + 12..start + 16].copy_from_slice(&open.runs.to_le_bytes());
    seal_record(out, start);
    debug_assert!(decode_record(&out[start + RECORD_HEADER_BYTES..]).is_ok());
}

/// Where varints are written: a buffer, or a small fixed array (the chunk index's entries).
pub(crate) trait ByteSink {
    fn put(&mut self, byte: u8);
}

impl ByteSink for Vec<u8> {
    fn put(&mut self, byte: u8) {
        self.push(byte);
    }
}

/// Appends `value` as a LEB128 varint: 7 bits per byte, low bits first, the top bit set on
/// every byte but the last (log batch runs here, and the in-memory chunk index).
pub(crate) fn put_varint(out: &mut impl ByteSink, mut value: u64) {
    while value >= 0x80 {
        // Truncation is intended: the low 7 bits, with the continuation bit.
        #[allow(clippy::cast_possible_truncation)]
        out.put((value as u8) | 0x80);
        value >>= 7;
    }
    // The loop left at most 7 bits.
    #[allow(clippy::cast_possible_truncation)]
    out.put(value as u8);
}

/// Reads a LEB128 varint at `*at`, moving `*at` past it; `None` if it is cut short or does
/// not fit in a u64.
fn get_varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0_u64;
    for shift in (0..64).step_by(7) {
        let byte = *bytes.get(*at)?;
        *at += 1;
        let bits = u64::from(byte & 0x7f);
        if shift == 63 && bits > 1 {
            return None;
        }
        value |= bits << shift;
        if byte & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

/// The kind byte of the record starting at `record` (header included): 1 chunk, 2 trim,
/// 3 delete, 4 log, 5 floor, 6 log batch.
pub fn record_kind(record: &[u8]) -> u8 {
    record[RECORD_HEADER_BYTES]
}

/// Whether a record kind is a trim or a delete.
pub fn is_trim_or_delete(kind: u8) -> bool {
    kind == KIND_TRIM || kind == KIND_DELETE
}

/// Appends one trim record: the queue's messages before `first_retained_offset` are gone.
pub fn encode_trim(out: &mut Vec<u8>, name: &[u8], first_retained_offset: u64) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&to_u32(TRIM_FIXED_BYTES + name.len()).to_le_bytes());
    out.push(KIND_TRIM);
    out.push(name_length_byte(name));
    out.extend_from_slice(&[0; 6]);
    out.extend_from_slice(&first_retained_offset.to_le_bytes());
    out.extend_from_slice(name);
    seal_record(out, start);
}

/// Appends one floor record (kind 5, version 3): every log record before `position` of
/// `segment` (in that segment or an older one) holds only messages that are in chunk records
/// written before this record, or trimmed, or deleted, so recovery may skip them.
pub fn encode_floor(out: &mut Vec<u8>, floor: LogFloor) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&to_u32(FLOOR_BODY_BYTES).to_le_bytes());
    out.push(KIND_FLOOR);
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&floor.segment.to_le_bytes());
    out.extend_from_slice(&floor.position.to_le_bytes());
    seal_record(out, start);
}

/// A place in the log before which no log record is needed (see [`encode_floor`]). Ordered by
/// segment, then position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct LogFloor {
    /// Segment id.
    pub segment: u32,
    /// Byte position in the segment.
    pub position: u64,
}

impl LogFloor {
    /// Whether the floor covers a record at `position` of `segment` (the record is before it).
    pub fn covers(self, segment: u32, position: u64) -> bool {
        (segment, position) < (self.segment, self.position)
    }
}

/// Appends one delete record: every earlier record of the queue is dead.
pub fn encode_delete(out: &mut Vec<u8>, name: &[u8]) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&to_u32(DELETE_FIXED_BYTES + name.len()).to_le_bytes());
    out.push(KIND_DELETE);
    out.push(name_length_byte(name));
    out.extend_from_slice(&[0; 2]);
    out.extend_from_slice(name);
    seal_record(out, start);
}

fn seal_record(out: &mut [u8], start: usize) {
    let crc = crc32c::crc32c(&out[start + 4..]);
    out[start..start + 4].copy_from_slice(&crc.to_le_bytes());
}

fn name_length_byte(name: &[u8]) -> u8 {
    // Invariant: queue names are validated to 1..=255 bytes before any record is encoded.
    u8::try_from(name.len()).expect("queue name length checked at the API boundary")
}

fn to_u32(value: usize) -> u32 {
    // Invariant: record bodies are at most RECORD_BODY_BYTES_MAX (checked by StoreOptions).
    u32::try_from(value).expect("record body bounded by RECORD_BODY_BYTES_MAX")
}

/// A decoded record body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record<'a> {
    /// Consecutive messages of one queue.
    Chunk(Chunk<'a>),
    /// Messages of `name` before `first_retained_offset` are gone.
    Trim {
        /// Queue name.
        name: &'a [u8],
        /// First offset still retained.
        first_retained_offset: u64,
    },
    /// The queue and every earlier record of it are gone.
    Delete {
        /// Queue name.
        name: &'a [u8],
    },
    /// Consecutive messages of one queue, durable but not indexed (format version 2): a
    /// later chunk record of the same offsets supersedes it.
    Log(Chunk<'a>),
    /// Log records before this place are no longer needed (format version 3).
    Floor(LogFloor),
    /// Runs of consecutive messages of any queues, durable but not indexed, like log records
    /// (format version 4).
    LogBatch(LogBatch<'a>),
}

/// A decoded log batch body: its runs, each like a log record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogBatch<'a> {
    /// When the record was opened, in ms since the Unix epoch.
    pub timestamp_ms: u64,
    /// Number of runs.
    pub runs: u32,
    /// The runs' bytes (checked by the decoder).
    bytes: &'a [u8],
}

/// One run of a log batch: consecutive messages of one queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRun<'a> {
    /// Queue name.
    pub name: &'a [u8],
    /// Offset of the first message.
    pub first_offset: u64,
    /// Number of messages.
    pub count: u32,
    /// The messages, each a varint length then its bytes.
    bytes: &'a [u8],
}

impl<'a> LogBatch<'a> {
    /// The runs, in the order they were appended.
    pub fn runs(&self) -> impl Iterator<Item = LogRun<'a>> + use<'a> {
        let mut rest = self.bytes;
        std::iter::from_fn(move || {
            // Checked by `decode_log_batch`: a failure here only ends the iteration.
            let (run, used) = parse_log_run(rest).ok()?;
            rest = &rest[used..];
            Some(run)
        })
    }
}

impl<'a> LogRun<'a> {
    /// The messages, in offset order.
    pub fn messages(&self) -> impl Iterator<Item = &'a [u8]> + use<'a> {
        let (bytes, mut at) = (self.bytes, 0);
        std::iter::from_fn(move || {
            let length = usize::try_from(get_varint(bytes, &mut at)?).ok()?;
            let message = bytes.get(at..at.checked_add(length)?)?;
            at += length;
            Some(message)
        })
    }
}

/// Parses the run at the start of `bytes`; returns it and the bytes it takes.
fn parse_log_run(bytes: &[u8]) -> Result<(LogRun<'_>, usize), &'static str> {
    let cut = "log batch run cut short";
    let name_bytes = usize::from(*bytes.first().ok_or(cut)?);
    if name_bytes == 0 {
        return Err("empty queue name");
    }
    let name = bytes.get(1..1 + name_bytes).ok_or(cut)?;
    let mut at = 1 + name_bytes;
    let first_offset = get_varint(bytes, &mut at).ok_or("log batch run offset malformed")?;
    let count = get_varint(bytes, &mut at)
        .and_then(|count| u32::try_from(count).ok())
        .filter(|&count| count > 0)
        .ok_or("log batch run count malformed or zero")?;
    let messages_start = at;
    for _ in 0..count {
        let length = get_varint(bytes, &mut at)
            .and_then(|length| usize::try_from(length).ok())
            .ok_or("log batch message length malformed")?;
        at = at
            .checked_add(length)
            .filter(|&end| end <= bytes.len())
            .ok_or("log batch message runs past the record")?;
    }
    if first_offset.checked_add(u64::from(count)).is_none() {
        return Err("log batch run offsets overflow");
    }
    let run = LogRun {
        name,
        first_offset,
        count,
        bytes: &bytes[messages_start..at],
    };
    Ok((run, at))
}

/// Checks a log batch body (its kind byte included) run by run.
fn decode_log_batch(body: &[u8]) -> Result<LogBatch<'_>, &'static str> {
    if body.len() < LOG_BATCH_FIXED_BYTES {
        return Err("record body too short");
    }
    if body[1..4] != [0, 0, 0] {
        return Err("log batch reserved bytes not zero");
    }
    let runs = read_u32(body, 4);
    let bytes = &body[LOG_BATCH_FIXED_BYTES..];
    let mut rest = bytes;
    for _ in 0..runs {
        let (_, used) = parse_log_run(rest)?;
        rest = &rest[used..];
    }
    if runs == 0 {
        return Err("log batch without runs");
    }
    if !rest.is_empty() {
        return Err("log batch has trailing bytes");
    }
    Ok(LogBatch {
        timestamp_ms: read_u64(body, 8),
        runs,
        bytes,
    })
}

/// A decoded chunk body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk<'a> {
    /// Queue name.
    pub name: &'a [u8],
    /// Offset of the first message.
    pub first_offset: u64,
    /// When the chunk was sealed, in ms since the Unix epoch.
    pub timestamp_ms: u64,
    /// Number of messages.
    pub count: u32,
    lengths: &'a [u8],
    payload: &'a [u8],
}

impl<'a> Chunk<'a> {
    /// The messages, in offset order.
    pub fn messages(&self) -> impl Iterator<Item = &'a [u8]> + use<'a> {
        let mut rest = self.payload;
        self.lengths.chunks_exact(4).map(move |length| {
            let length = usize::try_from(read_u32(length, 0)).unwrap_or(usize::MAX);
            let (message, tail) = rest.split_at(length);
            rest = tail;
            message
        })
    }
}

/// Checks the record header at the start of `bytes` and returns `(crc, body_length)`.
pub fn decode_record_header(bytes: &[u8; RECORD_HEADER_BYTES]) -> (u32, usize) {
    let length = usize::try_from(read_u32(bytes, 4)).unwrap_or(usize::MAX);
    (read_u32(bytes, 0), length)
}

/// Verifies a whole record (header and body) and decodes its body.
pub fn decode_checked(record: &[u8]) -> Result<Record<'_>, &'static str> {
    if record.len() < RECORD_HEADER_BYTES {
        return Err("record shorter than its header");
    }
    if !checksum_matches(record) {
        return Err("record checksum mismatch");
    }
    decode_record(&record[RECORD_HEADER_BYTES..])
}

/// Whether a whole record (at least its header) carries the checksum of its bytes.
pub fn checksum_matches(record: &[u8]) -> bool {
    record.len() >= RECORD_HEADER_BYTES && crc32c::crc32c(&record[4..]) == read_u32(record, 0)
}

/// Whether a whole record's kind byte says log or log batch record (not verified: check the
/// checksum).
pub fn is_log_record(record: &[u8]) -> bool {
    matches!(
        record.get(RECORD_HEADER_BYTES),
        Some(&(KIND_LOG | KIND_LOG_BATCH))
    )
}

/// Decodes a record body whose checksum was already verified.
pub fn decode_record(body: &[u8]) -> Result<Record<'_>, &'static str> {
    let (&kind, _) = body.split_first().ok_or("empty record body")?;
    if kind == KIND_FLOOR {
        if body.len() != FLOOR_BODY_BYTES {
            return Err("floor record of the wrong length");
        }
        return Ok(Record::Floor(LogFloor {
            segment: read_u32(body, 4),
            position: read_u64(body, 8),
        }));
    }
    if kind == KIND_LOG_BATCH {
        return decode_log_batch(body).map(Record::LogBatch);
    }
    let name_bytes = usize::from(*body.get(1).ok_or("record body too short")?);
    let fixed = match kind {
        KIND_CHUNK | KIND_LOG => CHUNK_FIXED_BYTES,
        KIND_TRIM => TRIM_FIXED_BYTES,
        KIND_DELETE => DELETE_FIXED_BYTES,
        _ => return Err("unknown record kind"),
    };
    if name_bytes == 0 {
        return Err("empty queue name");
    }
    if body.len() < fixed + name_bytes {
        return Err("record body too short");
    }
    let name = &body[fixed..fixed + name_bytes];
    match kind {
        KIND_CHUNK | KIND_LOG => {
            let count = read_u32(body, 4);
            let first_offset = read_u64(body, 8);
            let timestamp_ms = read_u64(body, 16);
            let lengths_bytes = usize::try_from(count)
                .ok()
                .and_then(|count| count.checked_mul(4))
                .ok_or("message count too large")?;
            let rest = &body[fixed + name_bytes..];
            if rest.len() < lengths_bytes {
                return Err("chunk message lengths cut short");
            }
            let (lengths, payload) = rest.split_at(lengths_bytes);
            let total: u64 = lengths
                .chunks_exact(4)
                .map(|length| u64::from(read_u32(length, 0)))
                .sum();
            if total != payload.len() as u64 {
                return Err("chunk message lengths do not match its payload");
            }
            if count == 0 {
                return Err("chunk without messages");
            }
            let chunk = Chunk {
                name,
                first_offset,
                timestamp_ms,
                count,
                lengths,
                payload,
            };
            Ok(if kind == KIND_LOG {
                Record::Log(chunk)
            } else {
                Record::Chunk(chunk)
            })
        }
        KIND_TRIM => {
            if body.len() != fixed + name_bytes {
                return Err("trim record has trailing bytes");
            }
            Ok(Record::Trim {
                name,
                first_retained_offset: read_u64(body, 8),
            })
        }
        _ => {
            if body.len() != fixed + name_bytes {
                return Err("delete record has trailing bytes");
            }
            Ok(Record::Delete { name })
        }
    }
}

fn slice_array<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0_u8; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

/// Reads a little-endian u32 at `at`.
pub fn read_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(slice_array(bytes, at))
}

/// Reads a little-endian u64 at `at`.
pub fn read_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(slice_array(bytes, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_framed_messages_when_encoded_should_match_encode_chunk() {
        let mut plain = Vec::new();
        encode_chunk(&mut plain, b"q1", 7, 99, &[1, 0, 3], b"abcd");
        let mut framed_input = Vec::new();
        for message in [&b"a"[..], b"", b"bcd"] {
            let length = u32::try_from(message.len()).unwrap();
            framed_input.extend_from_slice(&length.to_le_bytes());
            framed_input.extend_from_slice(message);
        }
        let mut framed = vec![0xee];
        encode_chunk_framed(&mut framed, b"q1", 7, 99, 3, 4, &framed_input);
        assert_eq!(&framed[1..], &plain[..]);
    }

    #[test]
    fn given_chunk_when_encoded_should_decode_same_messages() {
        let mut out = Vec::new();
        encode_chunk(&mut out, b"q1", 7, 99, &[1, 0, 3], b"abcd");
        assert_eq!(out.len(), chunk_record_bytes(2, 3, 4));
        let Ok(Record::Chunk(chunk)) = decode_checked(&out) else {
            panic!("not a chunk")
        };
        assert_eq!(chunk.name, b"q1");
        assert_eq!(chunk.first_offset, 7);
        assert_eq!(chunk.timestamp_ms, 99);
        let messages: Vec<&[u8]> = chunk.messages().collect();
        assert_eq!(messages, vec![&b"a"[..], b"", b"bcd"]);
    }

    /// Flips each byte of an encoded record in turn: the decoder must refuse every copy.
    fn assert_every_flipped_byte_refused(record: &[u8]) {
        for index in 0..record.len() {
            let mut damaged = record.to_vec();
            damaged[index] ^= 0x10;
            assert!(
                decode_checked(&damaged).is_err(),
                "flip at {index} accepted"
            );
        }
    }

    #[test]
    fn given_any_flipped_byte_when_decoded_should_refuse() {
        let mut out = Vec::new();
        encode_chunk(&mut out, b"queue", 1, 2, &[5], b"hello");
        assert_every_flipped_byte_refused(&out);
    }

    #[test]
    fn given_trim_and_delete_when_encoded_should_roundtrip() {
        let mut out = Vec::new();
        encode_trim(&mut out, b"t", 42);
        let trim_end = out.len();
        encode_delete(&mut out, b"d");
        assert_eq!(
            decode_checked(&out[..trim_end]),
            Ok(Record::Trim {
                name: b"t",
                first_retained_offset: 42
            })
        );
        assert_eq!(
            decode_checked(&out[trim_end..]),
            Ok(Record::Delete { name: b"d" })
        );
    }

    /// A log batch run as owned values: name, first offset, count, messages.
    type DecodedRun = (Vec<u8>, u64, u32, Vec<Vec<u8>>);

    /// Two log batch records: the first sealed when it passed the target, the second by hand.
    fn two_log_batches() -> (Vec<u8>, usize) {
        let mut out = Vec::new();
        let mut open = None;
        let big = vec![7_u8; LOG_BATCH_BODY_TARGET];
        append_log_run(&mut out, &mut open, b"q1", 300, 5, &[b"a", b""]);
        append_log_run(&mut out, &mut open, b"q2", 0, 6, &[&big]);
        let first_end = out.len();
        append_log_run(&mut out, &mut open, b"q1", 302, 7, &[b"bcd"]);
        assert_eq!(
            open.map(|open| open.start),
            Some(first_end),
            "past the target: a new record"
        );
        seal_log_batch(&mut out, open.unwrap());
        (out, first_end)
    }

    #[test]
    fn given_log_runs_when_encoded_should_decode_the_same_runs_per_record() {
        let (out, first_end) = two_log_batches();
        let Ok(Record::LogBatch(first)) = decode_checked(&out[..first_end]) else {
            panic!("not a log batch")
        };
        assert_eq!((first.timestamp_ms, first.runs), (5, 2));
        let runs: Vec<DecodedRun> = first
            .runs()
            .map(|run| {
                let messages = run.messages().map(<[u8]>::to_vec).collect();
                (run.name.to_vec(), run.first_offset, run.count, messages)
            })
            .collect();
        assert_eq!(
            runs,
            vec![
                (b"q1".to_vec(), 300, 2, vec![b"a".to_vec(), Vec::new()]),
                (
                    b"q2".to_vec(),
                    0,
                    1,
                    vec![vec![7_u8; LOG_BATCH_BODY_TARGET]]
                ),
            ]
        );
        let Ok(Record::LogBatch(second)) = decode_checked(&out[first_end..]) else {
            panic!("not a log batch")
        };
        let run = second.runs().next().unwrap();
        assert_eq!(
            (second.timestamp_ms, run.name, run.first_offset),
            (7, &b"q1"[..], 302)
        );
        assert_eq!(run.messages().collect::<Vec<_>>(), vec![&b"bcd"[..]]);
        assert!(is_log_record(&out) && is_log_record(&out[first_end..]));
        // The budget's bound covers a run with its varints at their longest, in a record
        // of its own.
        let mut single = Vec::new();
        let mut open = None;
        let long = vec![1_u8; 200];
        append_log_run(
            &mut single,
            &mut open,
            b"q1",
            u64::MAX - 2,
            0,
            &[&long, b""],
        );
        seal_log_batch(&mut single, open.unwrap());
        assert!(single.len() <= log_run_bytes_max(2, &[&long, b""]));
    }

    #[test]
    fn given_a_log_batch_with_any_flipped_byte_or_a_bad_run_when_decoded_should_refuse() {
        let mut out = Vec::new();
        let mut open = None;
        append_log_run(&mut out, &mut open, b"queue", 1 << 40, 2, &[b"hello", b"x"]);
        append_log_run(&mut out, &mut open, b"other", 0, 2, &[b"y"]);
        seal_log_batch(&mut out, open.unwrap());
        assert_every_flipped_byte_refused(&out);
        // Checksums right, runs wrong: each names its problem.
        let reseal = |edit: &dyn Fn(&mut Vec<u8>)| {
            let mut copy = out.clone();
            edit(&mut copy);
            let body = copy.len() - RECORD_HEADER_BYTES;
            copy[4..8].copy_from_slice(&to_u32(body).to_le_bytes());
            seal_record(&mut copy, 0);
            decode_checked(&copy).err()
        };
        assert_eq!(
            reseal(&|copy| copy[12] = 3),
            Some("log batch run cut short")
        );
        assert_eq!(
            reseal(&|copy| copy[12] = 1),
            Some("log batch has trailing bytes")
        );
        assert_eq!(reseal(&|copy| copy[12] = 0), Some("log batch without runs"));
        assert_eq!(
            reseal(&|copy| copy.push(0)),
            Some("log batch has trailing bytes")
        );
        assert_eq!(reseal(&|copy| copy[24] = 0), Some("empty queue name"));
        // The first run's count (after "queue" and a 6-byte offset) set to zero.
        assert_eq!(
            reseal(&|copy| copy[24 + 1 + 5 + 6] = 0),
            Some("log batch run count malformed or zero")
        );
    }

    #[test]
    fn given_varints_when_encoded_should_roundtrip_and_refuse_overflow() {
        for value in [0, 1, 127, 128, 300, 1 << 35, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, value);
            let mut at = 0;
            assert_eq!(get_varint(&out, &mut at), Some(value));
            assert_eq!(at, out.len());
            assert_eq!(get_varint(&out[..out.len() - 1], &mut 0), None, "cut short");
        }
        let too_big = [0xff; 9].iter().copied().chain([0x02]).collect::<Vec<u8>>();
        assert_eq!(get_varint(&too_big, &mut 0), None);
        assert_eq!(get_varint(&[0x80; 11], &mut 0), None);
    }

    #[test]
    fn given_a_floor_when_encoded_should_roundtrip_and_refuse_any_flipped_byte() {
        let floor = LogFloor {
            segment: 7,
            position: 1 << 33,
        };
        let mut out = Vec::new();
        encode_floor(&mut out, floor);
        assert_eq!(out.len(), FLOOR_RECORD_BYTES);
        assert_eq!(decode_checked(&out), Ok(Record::Floor(floor)));
        assert_every_flipped_byte_refused(&out);
        assert!(floor.covers(6, u64::MAX));
        assert!(floor.covers(7, (1 << 33) - 1));
        assert!(!floor.covers(7, 1 << 33));
        assert!(!floor.covers(8, 0));
        assert!(
            !LogFloor::default().covers(0, 0),
            "the default floor covers nothing"
        );
    }

    #[test]
    fn given_header_when_version_or_magic_differs_should_say_what_was_found() {
        let header = encode_segment_header(5);
        assert_eq!(decode_segment_header(&header), Ok(5));
        let mut other = header;
        other[8] = 5;
        assert_eq!(
            decode_segment_header(&other),
            Err(HeaderProblem::Version(5))
        );
        // Version 1 (no log records) is still read.
        let mut version_1 = header;
        version_1[8] = 1;
        let crc = crc32c::crc32c(&version_1[0..28]);
        version_1[28..32].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode_segment_header(&version_1), Ok(5));
        let mut foreign = header;
        foreign[0] = b'X';
        assert!(matches!(
            decode_segment_header(&foreign),
            Err(HeaderProblem::NotLevee(_))
        ));
    }

    #[test]
    fn given_segment_names_when_parsed_should_accept_only_ours() {
        assert_eq!(parse_segment_file_name(&segment_file_name(17)), Some(17));
        assert_eq!(parse_segment_file_name("segment-17.lvq"), None);
        assert_eq!(parse_segment_file_name("notes.txt"), None);
    }
}
