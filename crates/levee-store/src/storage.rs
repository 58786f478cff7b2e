//! The small file-system interface the store uses: one flat directory of files that are read
//! at positions, appended to, synced and truncated. [`OsStorage`] is the real one;
//! [`crate::SimulatedDisk`] is a test double that loses unsynced data at a simulated crash.

use std::fmt;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// A directory of files. Names are plain file names, never paths.
pub trait Storage: Send + Sync + fmt::Debug {
    /// Names of the files in the directory.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Creates an empty file; fails if it exists. Durable only after [`Storage::sync_dir`].
    fn create(&self, name: &str) -> io::Result<Arc<dyn StorageFile>>;
    /// Opens an existing file for reading and writing.
    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>>;
    /// Removes a file. Durable only after [`Storage::sync_dir`]; open handles stay readable.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Makes creations and removals in the directory durable (fsync of the directory).
    fn sync_dir(&self) -> io::Result<()>;
    /// Takes an exclusive lock on the directory for as long as this storage lives, so two
    /// processes never write the same store. Fails if another holder has it.
    fn lock_directory(&self) -> io::Result<()>;
}

/// Name of the lock file [`OsStorage`] keeps in the data directory.
pub const LOCK_FILE_NAME: &str = "LOCK";

/// One open file.
#[allow(
    clippy::len_without_is_empty,
    reason = "nothing asks whether a segment is empty"
)]
pub trait StorageFile: Send + Sync + fmt::Debug {
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Fills `buffer` from `position`; an error if the file ends first.
    fn read_at(&self, position: u64, buffer: &mut [u8]) -> io::Result<()>;
    /// Reads into `buffer` from `position` as many bytes as the file holds there, up to the
    /// buffer's length; returns how many (fewer only at the end of the file).
    fn read_up_to(&self, position: u64, buffer: &mut [u8]) -> io::Result<usize>;
    /// Writes all of `data` at `position`.
    fn write_at(&self, position: u64, data: &[u8]) -> io::Result<()>;
    /// Writes `bytes` at their position like [`StorageFile::write_at`], then empties them for
    /// the bytes that follow. A file that writes in the background may keep their memory and
    /// put other memory in its place (see [`WriteBytes`]). After an error `bytes` hold nothing
    /// certain: the caller cuts the file back and starts them again.
    fn write_bytes(&self, bytes: &mut WriteBytes) -> io::Result<()> {
        self.write_at(bytes.position(), bytes)?;
        bytes.reset(bytes.end());
        Ok(())
    }
    /// Returns once every write so far has reached the file (a write may return before that),
    /// with the error of the first that failed since the last call. Such a failure is also
    /// reported by the next `write_at` or `sync`; a `truncate` that cuts it off forgets it.
    fn finish_writes(&self) -> io::Result<()> {
        Ok(())
    }
    /// The file position before which every write so far has reached the file, without
    /// waiting: the start of the first write still on its way (`u64::MAX` with none; a file
    /// whose writes return once done: always). 0 while a failed write is not yet reported.
    fn written_through(&self) -> u64 {
        u64::MAX
    }
    /// Makes every write so far durable (fdatasync).
    fn sync(&self) -> io::Result<()>;
    /// Cuts the file to `length` bytes.
    fn truncate(&self, length: u64) -> io::Result<()>;
}

/// Bytes built for one write at a file position, laid out so that a file writing with
/// `O_DIRECT` can hand their block-aligned middle to the disk as they are: byte `i` sits at an
/// address congruent to `position + i` modulo 4 KiB (the buffer starts with up to 4 KiB of
/// padding). Growing keeps the layout; it and [`WriteBytes::reset`] keep the capacity.
#[derive(Debug, Default)]
pub struct WriteBytes {
    /// `pad` bytes of padding, then the bytes.
    data: Vec<u8>,
    pad: usize,
    position: u64,
}

impl WriteBytes {
    /// Empty bytes for position 0.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Empties them for bytes that go at `position`.
    pub fn reset(&mut self, position: u64) {
        self.data.clear();
        // Room for the padding, so that adding it does not move the buffer.
        self.data.reserve(DIRECT_ALIGN_BYTES);
        self.position = position;
        self.pad = Self::pad_for(&self.data, position);
        self.data.resize(self.pad, 0);
    }

    /// Where the bytes go in the file.
    #[must_use]
    pub fn position(&self) -> u64 {
        self.position
    }

    /// The file position just past the bytes.
    #[must_use]
    pub fn end(&self) -> u64 {
        self.position + self.len() as u64
    }

    /// Appends `bytes`.
    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.reserve(bytes.len());
        self.data.extend_from_slice(bytes);
    }

    /// Makes room for `additional` more bytes, keeping the layout.
    pub fn reserve(&mut self, additional: usize) {
        let needed = self.data.len() + additional;
        if needed <= self.data.capacity() {
            return;
        }
        let capacity = needed.max(self.data.capacity() * 2) + DIRECT_ALIGN_BYTES;
        let mut grown = Vec::with_capacity(capacity);
        let pad = Self::pad_for(&grown, self.position);
        grown.resize(pad, 0);
        grown.extend_from_slice(&self.data[self.pad..]);
        self.data = grown;
        self.pad = pad;
    }

    /// The buffer, padding included, for encoders that append to a `Vec` (after
    /// [`WriteBytes::reserve`], so that they do not move it).
    pub(crate) fn vec_mut(&mut self) -> &mut Vec<u8> {
        &mut self.data
    }

    /// Whether byte `i` still sits at an address congruent to `position + i` modulo 4 KiB
    /// (a `Vec` that grew by itself moved).
    fn laid_out(&self) -> bool {
        self.pad <= self.data.len() && Self::pad_for(&self.data, self.position) == self.pad
    }

    /// Padding that puts `position` at an address congruent to it modulo 4 KiB in `data`.
    fn pad_for(data: &[u8], position: u64) -> usize {
        let address = data.as_ptr().addr() % DIRECT_ALIGN_BYTES;
        let wanted = usize::try_from(position % DIRECT_ALIGN).unwrap_or(0);
        (wanted + DIRECT_ALIGN_BYTES - address) % DIRECT_ALIGN_BYTES
    }

    /// Puts `memory` in place of the buffer (emptied for `position`); returns the buffer and
    /// where its bytes start in it.
    fn swap_memory(&mut self, memory: Vec<u8>, position: u64) -> (Vec<u8>, usize) {
        let old = (std::mem::replace(&mut self.data, memory), self.pad);
        self.reset(position);
        old
    }
}

impl std::ops::Deref for WriteBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.data[self.pad..]
    }
}

impl std::ops::DerefMut for WriteBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.data[self.pad..]
    }
}

/// [`Storage`] on a real directory.
#[derive(Debug, Clone)]
pub struct OsStorage {
    directory: PathBuf,
    lock: Arc<OnceLock<File>>,
    /// With direct writes: the background writer shared by every file of the directory
    /// ([`BOUNCE_BUFFERS`] aligned buffers of 8 MiB, allocated at their first use; only the
    /// committer writes large runs).
    writer: Option<Arc<DirectWriter>>,
}

impl OsStorage {
    /// Uses `directory`, creating it (and its parents) if missing.
    pub fn new(directory: impl AsRef<Path>) -> io::Result<Self> {
        let directory = directory.as_ref().to_path_buf();
        fs::create_dir_all(&directory)?;
        Ok(Self {
            directory,
            lock: Arc::new(OnceLock::new()),
            writer: None,
        })
    }

    /// Writes large runs with `O_DIRECT` (see [`crate::StoreOptions::direct_writes`]): the
    /// block-aligned middle of every write of 64 KiB or more goes to the disk without passing
    /// through the page cache; the unaligned ends, and smaller writes, go through it. Where the
    /// file system refuses `O_DIRECT`, files are written through the page cache as without it.
    #[must_use]
    pub fn with_direct_writes(mut self, direct: bool) -> Self {
        self.writer = direct.then(|| Arc::new(DirectWriter::new()));
        self
    }

    fn file(&self, name: &str, file: File) -> Arc<dyn StorageFile> {
        Arc::new(self.os_file(name, file))
    }

    fn os_file(&self, name: &str, file: File) -> OsFile {
        OsFile {
            file: Arc::new(file),
            path: self.directory.join(name),
            direct: OnceLock::new(),
            writer: self.writer.clone(),
            writes: Arc::new(FileWrites::default()),
        }
    }

    /// The directory.
    pub fn directory(&self) -> &Path {
        &self.directory
    }
}

impl Storage for OsStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(&self.directory)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        Ok(names)
    }

    fn create(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(self.directory.join(name))?;
        Ok(self.file(name, file))
    }

    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.directory.join(name))?;
        Ok(self.file(name, file))
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        fs::remove_file(self.directory.join(name))
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.directory)?.sync_all()
    }

    fn lock_directory(&self) -> io::Result<()> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.directory.join(LOCK_FILE_NAME))?;
        file.try_lock().map_err(|error| match error {
            TryLockError::WouldBlock => io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{} is in use by another process", self.directory.display()),
            ),
            TryLockError::Error(error) => error,
        })?;
        // The lock lives as long as the last clone of this storage.
        let _ = self.lock.set(file);
        Ok(())
    }
}

/// Direct writes are aligned to this (the page size, and a multiple of every logical block
/// size in use).
const DIRECT_ALIGN_BYTES: usize = 4096;
const DIRECT_ALIGN: u64 = DIRECT_ALIGN_BYTES as u64;
/// Writes with less than this many aligned bytes go through the page cache only.
const DIRECT_MIN_BYTES: u64 = 64 << 10;
/// The most one direct write carries.
const BOUNCE_BYTES: usize = 8 << 20;
/// Aligned buffers of the background writer: some being written while the next is filled.
/// With two, the committer of a 4 KiB-message put waited for a free one more often than for
/// anything else (the I/O thread's write of one takes about as long as filling one, and on
/// two busy cores its wake-up waits for a core); four took the put 15% further.
const BOUNCE_BUFFERS: usize = 4;
/// The most pieces handed to the background writer and not yet taken by it: the direct ones
/// are bounded by the aligned buffers, the buffered ones (each less than
/// `DIRECT_MIN_BYTES` + 8 KiB) by this.
const QUEUED_PIECES: usize = 8;

/// Capacity of a buffer of the background writer: a direct write's most, room to align it,
/// and slack for [`WriteBytes`] handed over whole (a commit round writes once it passes
/// [`crate::StoreOptions::round_write_bytes`], 8 MiB by default, by up to a queue's chunks).
const POOL_BUFFER_BYTES: usize = BOUNCE_BYTES + BOUNCE_BYTES / 4 + DIRECT_ALIGN_BYTES;
/// A buffer that comes back larger than this (bytes handed over after they grew for a large
/// record) is freed rather than kept.
const POOL_BUFFER_BYTES_KEPT_MAX: usize = 4 * BOUNCE_BYTES;

/// The bytes of a piece: for `O_DIRECT`, a buffer of the background writer's (`start` is
/// where the piece starts in it, at a 4 KiB-aligned address), or a copy of a small write that
/// goes through the page cache behind the pieces before it.
enum PieceBytes {
    Direct { buffer: Vec<u8>, start: usize },
    Buffered(Vec<u8>),
}

/// One piece on its way to the disk.
struct DirectJob {
    id: u64,
    position: u64,
    length: usize,
    bytes: PieceBytes,
    direct: Arc<File>,
    /// The page-cache handle, for a buffered piece and a rest the direct handle does not take.
    file: Arc<File>,
    writes: Arc<FileWrites>,
}

/// The background writer of a directory's direct writes: a thread (started at the first)
/// that writes the pieces in the order given, and the aligned buffers that circulate between
/// it and the writer (the committer), so the committer fills the next piece while the disk
/// takes the last. A small write made while pieces are in flight is a piece too, written
/// through the page cache in its turn: made at once, it would wait for the file's lock, which
/// a direct write that extends the file holds for the whole write (ext4), so the committer
/// would stall for each piece's whole write at each round's unaligned ends.
struct DirectWriter {
    /// `None` until the first direct write starts the thread.
    jobs: Mutex<Option<std::sync::mpsc::SyncSender<DirectJob>>>,
    free: Mutex<std::sync::mpsc::Receiver<Vec<u8>>>,
    returns: std::sync::mpsc::SyncSender<Vec<u8>>,
}

impl fmt::Debug for DirectWriter {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("DirectWriter")
            .finish_non_exhaustive()
    }
}

impl DirectWriter {
    fn new() -> Self {
        let (returns, free) = std::sync::mpsc::sync_channel(BOUNCE_BUFFERS);
        for _ in 0..BOUNCE_BUFFERS {
            // Allocated at its first use.
            let _ = returns.try_send(Vec::new());
        }
        Self {
            jobs: Mutex::new(None),
            free: Mutex::new(free),
            returns,
        }
    }

    /// A free buffer, empty, of [`POOL_BUFFER_BYTES`] or more; waits while every buffer is
    /// being written.
    fn take_buffer(&self) -> io::Result<Vec<u8>> {
        let mut buffer = self
            .free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .recv()
            .map_err(|_| io::Error::other("the store's direct writer thread has stopped"))?;
        buffer.clear();
        buffer.reserve_exact(POOL_BUFFER_BYTES);
        Ok(buffer)
    }

    /// Puts a buffer back among the free ones (a larger one than kept is freed, and its
    /// place allocated again at its next use).
    fn keep_buffer(returns: &std::sync::mpsc::SyncSender<Vec<u8>>, buffer: Vec<u8>) {
        let buffer = if buffer.capacity() > POOL_BUFFER_BYTES_KEPT_MAX {
            Vec::new()
        } else {
            buffer
        };
        let _ = returns.try_send(buffer);
    }

    /// Hands `job` to the thread (started at the first); on failure its buffer goes back to
    /// the free ones, so a failed submit never shrinks the pool.
    fn submit(&self, job: DirectJob) -> io::Result<()> {
        let mut jobs = self.jobs.lock().unwrap_or_else(PoisonError::into_inner);
        let sender = if let Some(sender) = jobs.as_ref() {
            sender
        } else {
            let (sender, receiver) = std::sync::mpsc::sync_channel::<DirectJob>(QUEUED_PIECES);
            let returns = self.returns.clone();
            let spawned = std::thread::Builder::new()
                .name("levee-store-io".to_owned())
                .spawn(move || {
                    // Ends when the last handle of the directory is dropped.
                    while let Ok(job) = receiver.recv() {
                        let (id, writes) = (job.id, Arc::clone(&job.writes));
                        // A panic (a bug) fails the piece rather than leaving its waiters
                        // waiting for it forever.
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job.run())) {
                            Ok(Some(buffer)) => Self::keep_buffer(&returns, buffer),
                            Ok(None) => {}
                            Err(_) => {
                                writes.finished(
                                    id,
                                    Err(io::Error::other("the store's I/O thread panicked")),
                                );
                                // Its buffer, if it had one, is replaced (a full pool refuses).
                                Self::keep_buffer(&returns, Vec::new());
                            }
                        }
                    }
                });
            if let Err(error) = spawned {
                self.give_back(job.bytes);
                return Err(error);
            }
            jobs.insert(sender)
        };
        sender.send(job).map_err(|refused| {
            self.give_back(refused.0.bytes);
            io::Error::other("the store's direct writer thread has stopped")
        })
    }

    /// Returns the buffer of a piece that was not written to the free ones.
    fn give_back(&self, bytes: PieceBytes) {
        if let PieceBytes::Direct { buffer, .. } = bytes {
            Self::keep_buffer(&self.returns, buffer);
        }
    }
}

impl DirectJob {
    /// Writes the piece, notes the outcome in its file's [`FileWrites`] and hands its buffer
    /// back, if it has one of the background writer's.
    fn run(self) -> Option<Vec<u8>> {
        let result = match &self.bytes {
            PieceBytes::Direct { buffer, start } => Self::write_direct(
                &buffer[*start..*start + self.length],
                self.position,
                &self.direct,
                &self.file,
                &self.writes,
            ),
            PieceBytes::Buffered(data) => self.file.write_all_at(data, self.position),
        };
        self.writes.finished(self.id, result);
        match self.bytes {
            PieceBytes::Direct { buffer, .. } => Some(buffer),
            PieceBytes::Buffered(_) => None,
        }
    }

    fn write_direct(
        data: &[u8],
        position: u64,
        direct: &File,
        file: &File,
        writes: &FileWrites,
    ) -> io::Result<()> {
        let mut written = 0;
        while written < data.len() {
            let at = position + written as u64;
            if writes.direct_refused.load(Ordering::Relaxed) {
                return file.write_all_at(&data[written..], at);
            }
            match direct.write_at(&data[written..], at) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(count) => written += count,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) if error.kind() == io::ErrorKind::InvalidInput => {
                    // An alignment the device does not take: this file goes through the page
                    // cache from now on.
                    writes.direct_refused.store(true, Ordering::Relaxed);
                }
                Err(error) => return Err(error),
            }
            if written % DIRECT_ALIGN_BYTES != 0 {
                // A short direct write leaves an unaligned rest: through the page cache.
                file.write_all_at(&data[written..], position + written as u64)?;
                written = data.len();
            }
        }
        Ok(())
    }
}

/// A file's direct writes still in flight, and the first one that failed.
#[derive(Debug, Default)]
struct FileWrites {
    /// How many pieces are in flight (read without the lock: most calls find none).
    in_flight: std::sync::atomic::AtomicUsize,
    state: Mutex<WritesState>,
    done: std::sync::Condvar,
    /// Set when a direct write was refused as invalid: the file is written through the page
    /// cache from then on.
    direct_refused: AtomicBool,
}

#[derive(Debug, Default)]
struct WritesState {
    /// The pieces in flight: id, position and length (a few: the aligned buffers bound the
    /// direct ones, the writer's queue of [`QUEUED_PIECES`] and the piece being written the
    /// others).
    pieces: Vec<(u64, u64, usize)>,
    /// The id of the next piece.
    next_id: u64,
    /// The first failed write since the error was last taken: its position and error.
    failed: Option<(u64, io::Error)>,
}

impl FileWrites {
    /// Notes a piece in flight; returns its id.
    fn started(&self, position: u64, length: usize) -> u64 {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let id = state.next_id;
        state.next_id += 1;
        state.pieces.push((id, position, length));
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        id
    }

    fn finished(&self, id: u64, result: io::Result<()>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(index) = state.pieces.iter().position(|piece| piece.0 == id) else {
            return;
        };
        let (_, position, _) = state.pieces.swap_remove(index);
        if let Err(error) = result
            && state.failed.is_none()
        {
            state.failed = Some((position, error));
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        drop(state);
        self.done.notify_all();
    }

    /// Waits until no write in flight overlaps `range`; returns the state, locked.
    fn idle(&self, range: std::ops::Range<u64>) -> std::sync::MutexGuard<'_, WritesState> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while state.pieces.iter().any(|&(_, position, length)| {
            position < range.end && range.start < position + length as u64
        }) {
            state = self
                .done
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state
    }

    /// Waits until no write in flight overlaps `range` (cheap when none is in flight, as for
    /// every read of a file that is not being written; a reader of what is already written
    /// never waits for the end of the file being written).
    fn wait(&self, range: std::ops::Range<u64>) {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            drop(self.idle(range));
        }
    }

    /// The first write that failed since the error was last taken, without waiting for those
    /// in flight.
    fn take_failed(&self) -> io::Result<()> {
        let failed = self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .failed
            .take();
        failed.map_or(Ok(()), |(_, error)| Err(error))
    }

    /// See [`StorageFile::written_through`]: pieces are written in the order of their
    /// positions, so every byte before the first one in flight is written.
    fn written_through(&self) -> u64 {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.failed.is_some() {
            return 0;
        }
        state
            .pieces
            .iter()
            .map(|&(_, position, _)| position)
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Waits until no write is in flight and returns the first that failed since the last
    /// call.
    fn finish(&self) -> io::Result<()> {
        match self.idle(0..u64::MAX).failed.take() {
            Some((_, error)) => Err(error),
            None => Ok(()),
        }
    }
}

#[derive(Debug)]
struct OsFile {
    file: Arc<File>,
    path: PathBuf,
    /// The same file opened with `O_DIRECT`, at its first large write; `None` where the file
    /// system refuses it.
    direct: OnceLock<Option<Arc<File>>>,
    writer: Option<Arc<DirectWriter>>,
    writes: Arc<FileWrites>,
}

impl OsFile {
    fn direct(&self) -> Option<&Arc<File>> {
        self.direct
            .get_or_init(|| {
                use std::os::unix::fs::OpenOptionsExt;
                OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&self.path)
                    .ok()
                    .map(Arc::new)
            })
            .as_ref()
    }

    /// For a write of `length` bytes at `position`: the background writer, the direct handle
    /// and the block-aligned middle, if it goes with `O_DIRECT` (see `write_direct`).
    fn direct_body(
        &self,
        position: u64,
        length: usize,
    ) -> Option<(&Arc<DirectWriter>, &Arc<File>, u64, u64)> {
        let writer = self.writer.as_ref()?;
        if self.writes.direct_refused.load(Ordering::Relaxed) {
            return None;
        }
        let end = position + length as u64;
        let body_start = position.next_multiple_of(DIRECT_ALIGN);
        let body_end = end / DIRECT_ALIGN * DIRECT_ALIGN;
        if body_end < body_start + DIRECT_MIN_BYTES {
            return None;
        }
        Some((writer, self.direct()?, body_start, body_end))
    }

    /// Writes the block-aligned middle of `data` with `O_DIRECT` on the background writer
    /// (through the page cache it would cost a page-cache page per 4 KiB, which on a VM whose
    /// freed memory the host takes back is a host page fault each) and its unaligned ends
    /// through the page cache. Returns false (nothing written) where that does not apply.
    /// The middle may still be on its way when this returns: every other call on the file
    /// waits for it, and [`StorageFile::finish_writes`] or `sync` report a failure.
    fn write_direct(&self, position: u64, data: &[u8]) -> io::Result<bool> {
        let Some((writer, direct, body_start, body_end)) = self.direct_body(position, data.len())
        else {
            return Ok(false);
        };
        let offset = |at: u64| usize::try_from(at - position).unwrap_or(usize::MAX);
        // The first block's rest after the previous write (which left that block cached).
        self.write_buffered(position, &data[..offset(body_start)])?;
        let mut at = body_start;
        while at < body_end {
            let length =
                usize::try_from((body_end - at).min(BOUNCE_BYTES as u64)).unwrap_or(BOUNCE_BYTES);
            let mut buffer = writer.take_buffer()?;
            // Invariant: the buffer has room for the padding and the piece, so it does not move.
            let start = buffer.as_ptr().align_offset(DIRECT_ALIGN_BYTES);
            buffer.resize(start, 0);
            buffer.extend_from_slice(&data[offset(at)..offset(at) + length]);
            let bytes = PieceBytes::Direct { buffer, start };
            self.submit(writer, direct, at, length, bytes)?;
            at += length as u64;
        }
        // The last block's start, which the next write completes from the page cache.
        self.write_buffered(body_end, &data[offset(body_end)..])?;
        Ok(true)
    }

    /// As `write_direct`, for bytes laid out for it: their middle goes to the background
    /// writer as it is, their memory with it, and one of the writer's free buffers takes its
    /// place in `bytes` (waiting while all are being written). Returns false (nothing written)
    /// where that does not apply.
    fn write_direct_bytes(&self, bytes: &mut WriteBytes) -> io::Result<bool> {
        let position = bytes.position();
        let Some((writer, direct, body_start, body_end)) = self.direct_body(position, bytes.len())
        else {
            return Ok(false);
        };
        if !bytes.laid_out() {
            return Ok(false);
        }
        let offset = |at: u64| usize::try_from(at - position).unwrap_or(usize::MAX);
        let end = bytes.end();
        self.write_buffered(position, &bytes[..offset(body_start)])?;
        // The last block's start is written behind the middle, from a copy (under 4 KiB).
        let tail = bytes[offset(body_end)..].to_vec();
        let memory = writer.take_buffer()?;
        let (buffer, pad) = bytes.swap_memory(memory, end);
        let start = pad + offset(body_start);
        let length = offset(body_end) - offset(body_start);
        let piece = PieceBytes::Direct { buffer, start };
        self.submit(writer, direct, body_start, length, piece)?;
        self.write_buffered(body_end, &tail)?;
        Ok(true)
    }

    /// Writes `data` through the page cache: at once if no piece is in flight, else as a
    /// piece behind them (see [`DirectWriter`]).
    fn write_buffered(&self, position: u64, data: &[u8]) -> io::Result<()> {
        if !data.is_empty()
            && self.writes.in_flight.load(Ordering::SeqCst) > 0
            && let (Some(writer), Some(Some(direct))) = (&self.writer, self.direct.get())
        {
            let bytes = PieceBytes::Buffered(data.to_vec());
            return self.submit(writer, direct, position, data.len(), bytes);
        }
        self.file.write_all_at(data, position)
    }

    /// Hands one piece to the background writer, noted in flight.
    fn submit(
        &self,
        writer: &DirectWriter,
        direct: &Arc<File>,
        position: u64,
        length: usize,
        bytes: PieceBytes,
    ) -> io::Result<()> {
        let id = self.writes.started(position, length);
        let job = DirectJob {
            id,
            position,
            length,
            bytes,
            direct: Arc::clone(direct),
            file: Arc::clone(&self.file),
            writes: Arc::clone(&self.writes),
        };
        writer.submit(job).inspect_err(|_| {
            // Not in flight after all; the caller gets the error.
            self.writes.finished(id, Ok(()));
        })
    }
}

impl StorageFile for OsFile {
    fn len(&self) -> io::Result<u64> {
        self.writes.wait(0..u64::MAX);
        Ok(self.file.metadata()?.len())
    }

    fn read_at(&self, position: u64, buffer: &mut [u8]) -> io::Result<()> {
        self.writes
            .wait(position..position.saturating_add(buffer.len() as u64));
        self.file.read_exact_at(buffer, position)
    }

    fn read_up_to(&self, position: u64, buffer: &mut [u8]) -> io::Result<usize> {
        self.writes
            .wait(position..position.saturating_add(buffer.len() as u64));
        let mut filled = 0;
        while filled < buffer.len() {
            match self
                .file
                .read_at(&mut buffer[filled..], position + filled as u64)
            {
                Ok(0) => break,
                Ok(read) => filled += read,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(filled)
    }

    fn write_at(&self, position: u64, data: &[u8]) -> io::Result<()> {
        // A failed direct write is reported by the next call that writes or syncs.
        self.writes.take_failed()?;
        if self.write_direct(position, data)? {
            return Ok(());
        }
        self.write_buffered(position, data)
    }

    fn write_bytes(&self, bytes: &mut WriteBytes) -> io::Result<()> {
        self.writes.take_failed()?;
        if self.write_direct_bytes(bytes)? {
            return Ok(());
        }
        self.write_at(bytes.position(), bytes)?;
        bytes.reset(bytes.end());
        Ok(())
    }

    fn finish_writes(&self) -> io::Result<()> {
        self.writes.finish()
    }

    fn written_through(&self) -> u64 {
        self.writes.written_through()
    }

    fn sync(&self) -> io::Result<()> {
        self.writes.finish()?;
        self.file.sync_data()
    }

    fn truncate(&self, length: u64) -> io::Result<()> {
        let mut state = self.writes.idle(0..u64::MAX);
        // A failed write cut off entirely is forgotten; one that stays is still reported.
        if state
            .failed
            .as_ref()
            .is_some_and(|(position, _)| *position >= length)
        {
            state.failed = None;
        }
        drop(state);
        self.file.set_len(length)
    }
}

#[cfg(test)]
mod tests;
