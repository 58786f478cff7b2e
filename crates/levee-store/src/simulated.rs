//! A simulated disk for tests: files live in memory, and [`SimulatedDisk::crash`] returns the
//! disk as a power loss would leave it. Only synced bytes and synced directory entries are sure
//! to survive; of the unsynced tail of each file a random prefix survives (a torn write),
//! optionally with one damaged byte. Faults (a full disk, an I/O error) can be switched on.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;
use std::sync::Mutex;

use crate::storage::{Storage, StorageFile};

/// What an operation does to the disk, for fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operation {
    /// Reads, listing, removal, truncation: never faulted.
    Read,
    /// Writes and creates: need new blocks.
    Allocate,
    /// File and directory syncs.
    Sync,
}

/// A fault the disk injects until switched off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// No fault.
    None,
    /// Writes and creates fail with "no space left on device" (ENOSPC); syncs of data already
    /// written succeed, as blocks are allocated at write time.
    NoSpace,
    /// Writes, creates and syncs fail with a generic I/O error.
    Io,
    /// Syncs succeed after this long (a slow disk); nothing else changes.
    SlowSync(std::time::Duration),
}

/// How a crash treats unsynced bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashMode {
    /// Every unsynced byte is lost.
    DropUnsynced,
    /// A random prefix of each file's unsynced bytes survives.
    TearUnsynced,
    /// Like `TearUnsynced`, and one surviving unsynced byte is flipped.
    TearAndDamage,
}

#[derive(Debug, Default)]
struct FileData {
    bytes: Vec<u8>,
    durable: Vec<u8>,
    /// Length of the common prefix of `bytes` and `durable`.
    same_prefix: usize,
}

#[derive(Debug, Default)]
struct DiskState {
    /// The directory as the running program sees it.
    files: HashMap<String, Arc<Mutex<FileData>>>,
    /// The directory as it was at the last directory sync.
    durable_files: HashMap<String, Arc<Mutex<FileData>>>,
    fault: Option<Fault>,
    crashed: bool,
}

/// An in-memory [`Storage`] that can crash. Cloning shares the same disk.
#[derive(Debug, Clone, Default)]
pub struct SimulatedDisk {
    state: Arc<Mutex<DiskState>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl SimulatedDisk {
    /// An empty disk.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Injects `fault` into every later write, sync and create ([`Fault::None`] ends it).
    pub fn set_fault(&self, fault: Fault) {
        lock(&self.state).fault = (fault != Fault::None).then_some(fault);
    }

    /// Simulates a power loss: this disk fails every later operation, and the returned disk
    /// holds what survived. `seed` picks the torn lengths and damaged bytes.
    #[must_use]
    pub fn crash(&self, mode: CrashMode, seed: u64) -> SimulatedDisk {
        let mut random = seed ^ 0x9E37_79B9_7F4A_7C15;
        let mut state = lock(&self.state);
        state.crashed = true;
        let mut names: Vec<&String> = state.durable_files.keys().collect();
        names.sort();
        let mut survived = HashMap::new();
        for name in names {
            let file = lock(&state.durable_files[name]);
            let mut bytes = file.durable.clone();
            let still_linked = state
                .files
                .get(name)
                .is_some_and(|current| Arc::ptr_eq(current, &state.durable_files[name]));
            if mode != CrashMode::DropUnsynced
                && still_linked
                && file.bytes.len() > file.same_prefix
            {
                bytes.truncate(file.same_prefix);
                let unsynced = &file.bytes[file.same_prefix..];
                let kept = usize::try_from(next_random(&mut random) % (unsynced.len() as u64 + 1))
                    .unwrap_or(0);
                bytes.extend_from_slice(&unsynced[..kept]);
                if mode == CrashMode::TearAndDamage && kept > 0 {
                    let at = file.same_prefix
                        + usize::try_from(next_random(&mut random) % kept as u64).unwrap_or(0);
                    bytes[at] ^= 0x5A;
                }
            }
            let data = FileData {
                same_prefix: bytes.len(),
                durable: bytes.clone(),
                bytes,
            };
            survived.insert(name.clone(), Arc::new(Mutex::new(data)));
        }
        let state = DiskState {
            durable_files: survived.clone(),
            files: survived,
            fault: None,
            crashed: false,
        };
        SimulatedDisk {
            state: Arc::new(Mutex::new(state)),
        }
    }

    /// Total bytes of all files as the program sees them.
    pub fn total_bytes(&self) -> u64 {
        lock(&self.state)
            .files
            .values()
            .map(|file| lock(file).bytes.len() as u64)
            .sum()
    }

    /// Flips one bit of file `name` at `position` in both its current and its durable bytes.
    pub fn damage(&self, name: &str, position: usize) {
        let state = lock(&self.state);
        let mut file = lock(&state.files[name]);
        file.bytes[position] ^= 0x01;
        if position < file.durable.len() {
            file.durable[position] ^= 0x01;
        }
        file.same_prefix = file.same_prefix.min(position);
    }

    /// Writes `bytes` as the whole durable content of `name`, creating it if needed.
    pub fn put_file(&self, name: &str, bytes: &[u8]) {
        let mut state = lock(&self.state);
        let data = FileData {
            bytes: bytes.to_vec(),
            durable: bytes.to_vec(),
            same_prefix: bytes.len(),
        };
        let file = Arc::new(Mutex::new(data));
        state.files.insert(name.to_string(), file.clone());
        state.durable_files.insert(name.to_string(), file);
    }

    /// The bytes of file `name` as the program sees them.
    pub fn file_bytes(&self, name: &str) -> Option<Vec<u8>> {
        lock(&self.state)
            .files
            .get(name)
            .map(|file| lock(file).bytes.clone())
    }

    /// Fails if crashed or if the fault covers this kind of operation.
    fn check(&self, operation: Operation) -> io::Result<()> {
        let state = lock(&self.state);
        if state.crashed {
            return Err(io::Error::other("simulated disk crashed"));
        }
        match (state.fault, operation) {
            (Some(Fault::NoSpace), Operation::Allocate) => Err(io::Error::from_raw_os_error(28)),
            (Some(Fault::Io), Operation::Allocate | Operation::Sync) => {
                Err(io::Error::other("simulated I/O error"))
            }
            (Some(Fault::SlowSync(delay)), Operation::Sync) => {
                // Not holding the state meanwhile: other files, reads and `set_fault` go on.
                drop(state);
                std::thread::sleep(delay);
                if lock(&self.state).crashed {
                    return Err(io::Error::other("simulated disk crashed"));
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

fn next_random(state: &mut u64) -> u64 {
    // splitmix64
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Storage for SimulatedDisk {
    fn list(&self) -> io::Result<Vec<String>> {
        self.check(Operation::Read)?;
        Ok(lock(&self.state).files.keys().cloned().collect())
    }

    fn create(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        self.check(Operation::Allocate)?;
        let mut state = lock(&self.state);
        if state.files.contains_key(name) {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                name.to_string(),
            ));
        }
        let data = Arc::new(Mutex::new(FileData::default()));
        state.files.insert(name.to_string(), data.clone());
        Ok(Arc::new(SimulatedFile {
            disk: self.clone(),
            data,
        }))
    }

    fn open(&self, name: &str) -> io::Result<Arc<dyn StorageFile>> {
        self.check(Operation::Read)?;
        let state = lock(&self.state);
        let data = state
            .files
            .get(name)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_string()))?;
        Ok(Arc::new(SimulatedFile {
            disk: self.clone(),
            data,
        }))
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        self.check(Operation::Read)?;
        lock(&self.state)
            .files
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_string()))
    }

    fn lock_directory(&self) -> io::Result<()> {
        self.check(Operation::Read)
    }

    fn sync_dir(&self) -> io::Result<()> {
        self.check(Operation::Sync)?;
        let mut state = lock(&self.state);
        let files = state.files.clone();
        state.durable_files = files;
        Ok(())
    }
}

#[derive(Debug)]
struct SimulatedFile {
    disk: SimulatedDisk,
    data: Arc<Mutex<FileData>>,
}

impl StorageFile for SimulatedFile {
    fn len(&self) -> io::Result<u64> {
        self.disk.check(Operation::Read)?;
        Ok(lock(&self.data).bytes.len() as u64)
    }

    fn read_at(&self, position: u64, buffer: &mut [u8]) -> io::Result<()> {
        self.disk.check(Operation::Read)?;
        let data = lock(&self.data);
        let start = usize::try_from(position).map_err(io::Error::other)?;
        let end = start
            .checked_add(buffer.len())
            .filter(|end| *end <= data.bytes.len());
        let end = end.ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        buffer.copy_from_slice(&data.bytes[start..end]);
        Ok(())
    }

    fn read_up_to(&self, position: u64, buffer: &mut [u8]) -> io::Result<usize> {
        self.disk.check(Operation::Read)?;
        let data = lock(&self.data);
        let start = usize::try_from(position)
            .map_err(io::Error::other)?
            .min(data.bytes.len());
        let count = buffer.len().min(data.bytes.len() - start);
        buffer[..count].copy_from_slice(&data.bytes[start..start + count]);
        Ok(count)
    }

    fn write_at(&self, position: u64, bytes: &[u8]) -> io::Result<()> {
        self.disk.check(Operation::Allocate)?;
        let mut data = lock(&self.data);
        let start = usize::try_from(position).map_err(io::Error::other)?;
        if data.bytes.len() < start + bytes.len() {
            data.bytes.resize(start + bytes.len(), 0);
        }
        data.bytes[start..start + bytes.len()].copy_from_slice(bytes);
        data.same_prefix = data.same_prefix.min(start);
        Ok(())
    }

    fn sync(&self) -> io::Result<()> {
        self.disk.check(Operation::Sync)?;
        let mut data = lock(&self.data);
        let same = data.same_prefix;
        data.durable.truncate(same);
        let tail = data.bytes[same..].to_vec();
        data.durable.extend_from_slice(&tail);
        data.same_prefix = data.bytes.len();
        Ok(())
    }

    fn truncate(&self, length: u64) -> io::Result<()> {
        self.disk.check(Operation::Read)?;
        let mut data = lock(&self.data);
        let length = usize::try_from(length).map_err(io::Error::other)?;
        data.bytes.resize(length, 0);
        data.same_prefix = data.same_prefix.min(length);
        Ok(())
    }
}
