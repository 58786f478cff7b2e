//! `levee bench store`: the Tianchi queue-store race at a scale set by flags, against the
//! embedded store (no network): a put phase from many threads, a random check (10 messages from
//! a random offset of every queue) right after the put, the same again once the store's files
//! were read into the page cache, a sequential check (every fifth queue read whole), and a
//! reopen that measures recovery. Every message read back is compared with what was written.
//! The same disk's sequential write bandwidth is measured in the same run as the physical limit
//! (the faster of writing through the page cache and writing with `O_DIRECT`).
//! With `--baseline` (built with the `baseline` feature) the same workload runs against fjall, a
//! well-regarded embedded LSM store, with the same durability, and the ratios are reported.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, bail};
use levee_store::{MemoryUsage, OpenReport, Store, StoreOptions, SyncPolicy};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// Messages appended per call by one put thread.
const PUT_BATCH_MESSAGES: usize = 256;
/// Messages per read call in the sequential check.
const SEQUENTIAL_READ_MESSAGES: usize = 1_024;
/// Bytes written by the raw disk bandwidth probe (or less for small runs).
const RAW_PROBE_BYTES_MAX: u64 = 1 << 30;

#[derive(Debug, Clone, clap::Args)]
pub struct StoreBenchArgs {
    /// Queues
    #[arg(long, default_value_t = 1_000_000)]
    queues: u64,
    /// Messages in all, spread evenly over the queues
    #[arg(long, default_value_t = 100_000_000)]
    messages: u64,
    /// Bytes per message (at least 16: a message starts with its queue and offset)
    #[arg(long, default_value_t = 58)]
    message_bytes: usize,
    /// Threads putting and checking
    #[arg(long, default_value_t = 16)]
    threads: usize,
    /// When appends are fsynced: always (before each append returns, by group commit) or
    /// interval (within --interval-ms)
    #[arg(long, default_value = "always")]
    sync: String,
    /// With `--sync interval`: the fsync interval in ms (`interval(N)`)
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// The store's memory for write buffers and unwritten logs, in MiB (the server's
    /// `--queue-buffer-budget-mb`); the default is the store's
    #[arg(long, default_value_t = (StoreOptions::default().buffer_budget_bytes >> 20) as u64)]
    buffer_budget_mb: u64,
    /// Directory for the data, made if missing (a fresh subdirectory is made in it and
    /// removed after)
    #[arg(long, default_value = ".")]
    dir: PathBuf,
    /// Write every byte through the page cache (the store's `direct_writes` off)
    #[arg(long)]
    buffered_writes: bool,
    /// Run the same workload against fjall too (needs the `baseline` feature)
    #[arg(long)]
    baseline: bool,
    /// Print one JSON object on standard output (the summary goes to standard error)
    #[arg(long)]
    json: bool,
}

/// What a store under test offers the benchmark.
pub trait BenchTarget: Send + Sync {
    /// Appends a batch and returns once it is as durable as the sync policy says.
    fn append_batch(&self, batch: &[(&[u8], &[u8])]) -> anyhow::Result<()>;
    /// Reads up to `count` messages of `queue` from `offset`.
    fn read(&self, queue: &[u8], offset: u64, count: usize) -> anyhow::Result<Vec<Vec<u8>>>;
    /// Returns once every append so far is on disk (fsynced), whatever the sync policy.
    fn flush(&self) -> anyhow::Result<()>;
    /// fsyncs done so far.
    fn fsyncs(&self) -> u64;
}

struct LeveeTarget(Store);

impl BenchTarget for LeveeTarget {
    fn append_batch(&self, batch: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
        self.0.append_batch(batch)?;
        Ok(())
    }

    fn read(&self, queue: &[u8], offset: u64, count: usize) -> anyhow::Result<Vec<Vec<u8>>> {
        let batch = self.0.read(queue, offset, count, usize::MAX)?;
        Ok(batch.iter().map(<[u8]>::to_vec).collect())
    }

    fn flush(&self) -> anyhow::Result<()> {
        self.0.flush()?;
        Ok(())
    }

    fn fsyncs(&self) -> u64 {
        let stats = self.0.stats();
        stats.file_syncs + stats.dir_syncs
    }
}

/// The deterministic content of message `offset` of queue `queue`.
fn message(queue: u64, offset: u64, bytes: usize, out: &mut Vec<u8>) {
    out.clear();
    push_message(queue, offset, bytes, out);
}

/// Appends the message at `offset` of `queue`: the two numbers, then a filler repeating the
/// bytes of a seed derived from them (written 8 bytes at a time: load-generator work per
/// message is charged to the store under test).
fn push_message(queue: u64, offset: u64, bytes: usize, out: &mut Vec<u8>) {
    out.extend_from_slice(&queue.to_le_bytes());
    out.extend_from_slice(&offset.to_le_bytes());
    let seed = (queue.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ offset).to_le_bytes();
    let start = out.len();
    out.resize(start + bytes.saturating_sub(16), 0);
    // Whole 8-byte steps, then the rest: a copy of a length known at compile time is a
    // store, where `chunks_mut` (a shorter last chunk) made each step a call to memcpy, which
    // cost 4 KiB messages more CPU than the store's own copy of them.
    let mut chunks = out[start..].chunks_exact_mut(8);
    for chunk in &mut chunks {
        chunk.copy_from_slice(&seed);
    }
    let rest = chunks.into_remainder();
    let length = rest.len();
    rest.copy_from_slice(&seed[..length]);
}

fn queue_name(queue: u64) -> Vec<u8> {
    let mut name = Vec::with_capacity(9);
    push_queue_name(queue, &mut name);
    name
}

/// Appends `q` and the queue number in at least 8 digits (as `format!("q{queue:08}")`, without
/// the formatting machinery: it ran per message).
fn push_queue_name(queue: u64, out: &mut Vec<u8>) {
    out.push(b'q');
    let mut digits = [b'0'; 20];
    let (mut rest, mut used) = (queue, 0);
    while rest > 0 || used < 8 {
        used += 1;
        // Invariant: a digit is below 10.
        digits[20 - used] = b'0' + u8::try_from(rest % 10).unwrap_or(0);
        rest /= 10;
    }
    out.extend_from_slice(&digits[20 - used..]);
}

fn sync_policy(text: &str, interval_ms: u64) -> anyhow::Result<SyncPolicy> {
    match text {
        "always" => Ok(SyncPolicy::Always),
        "interval" => Ok(SyncPolicy::Interval { interval_ms }),
        other => bail!("--sync must be always or interval, got '{other}'"),
    }
}

/// The store's options from the flags, checked.
fn store_options(args: &StoreBenchArgs) -> anyhow::Result<StoreOptions> {
    let options = StoreOptions {
        sync: sync_policy(&args.sync, args.interval_ms)?,
        buffer_budget_bytes: args
            .buffer_budget_mb
            .checked_mul(1 << 20)
            .and_then(|bytes| usize::try_from(bytes).ok())
            .context("--buffer-budget-mb is too large")?,
        direct_writes: !args.buffered_writes,
        ..StoreOptions::default()
    };
    options
        .validate()
        .context("check --buffer-budget-mb and --interval-ms")?;
    Ok(options)
}

/// Checks the sizes and makes the run's fresh directory inside `--dir` (made if missing).
fn prepare(args: &StoreBenchArgs) -> anyhow::Result<tempfile::TempDir> {
    if args.queues == 0 || args.messages < args.queues || args.threads == 0 {
        bail!("need --queues >= 1, --messages >= --queues and --threads >= 1");
    }
    if args.message_bytes < 16 {
        bail!(
            "--message-bytes must be at least 16, got {}",
            args.message_bytes
        );
    }
    std::fs::create_dir_all(&args.dir)
        .with_context(|| format!("creating --dir {}", args.dir.display()))?;
    tempfile::Builder::new()
        .prefix("levee-bench-store-")
        .tempdir_in(&args.dir)
        .with_context(|| format!("creating a directory in {}", args.dir.display()))
}

pub fn run(args: &StoreBenchArgs) -> anyhow::Result<()> {
    let root = prepare(args)?;
    let data = root.path().join("levee");
    let options = store_options(args)?;
    eprintln!(
        "levee bench store: {} queues, {} messages of {} bytes, {} threads, sync {}, in {}",
        args.queues,
        args.messages,
        args.message_bytes,
        args.threads,
        args.sync,
        root.path().display()
    );
    let raw = RawDisk::probe(root.path(), args.messages * args.message_bytes as u64)?;
    let started = Instant::now();
    let (store, _) = Store::open(&data, options.clone())?;
    let open_s = started.elapsed().as_secs_f64();
    let target = LeveeTarget(store);
    let mut report = run_phases(args, &target, &data)?;
    let memory = target.0.memory_usage();
    let stats = target.0.stats();
    drop(target);
    let reopened = Instant::now();
    let (store, open_report) = Store::open(&data, options.clone())?;
    let recovery_s = reopened.elapsed().as_secs_f64();
    if open_report.messages != args.messages / args.queues * args.queues {
        bail!(
            "recovery found {} messages, expected {}",
            open_report.messages,
            args.messages / args.queues * args.queues
        );
    }
    let reopened_memory = store.memory_usage();
    drop(store);
    let stored = (args.messages / args.queues * args.queues) as f64;
    report["store"] = json!("levee");
    report["open_s"] = json!(open_s);
    report["recovery_s"] = json!(recovery_s);
    report["recovery"] = recovery_json(&open_report);
    report["peak_rss_bytes"] = json!(super::peak_rss_bytes("self"));
    report["disk_bytes"] = json!(stats.disk_bytes);
    // How the put went inside the store: rounds, and what held appenders back.
    report["store_stats"] = json!({
        "commit_rounds": stats.commit_rounds,
        "budget_flushes": stats.budget_flushes,
        "checkpoints": stats.checkpoints,
        "late_round_waits": stats.late_round_waits,
        "bytes_written": stats.bytes_written,
        "buffer_budget_bytes": options.buffer_budget_bytes,
    });
    report["direct_writes"] = json!(options.direct_writes);
    report["raw_disk_write_mb_per_s"] = json!(raw.best());
    report["raw_disk_write_buffered_mb_per_s"] = json!(raw.buffered);
    report["raw_disk_write_direct_mb_per_s"] = json!(raw.direct);
    report["put_vs_raw_disk"] = json!(report["put_mb_per_s"].as_f64().unwrap_or(0.0) / raw.best());
    report["memory"] = memory_json(&memory, args.queues, stored);
    // The same store reopened: every queue idle, its index rebuilt without growth slack.
    report["memory_after_recovery"] = memory_json(&reopened_memory, args.queues, stored);
    if args.baseline {
        let baseline = run_baseline(args, root.path())?;
        let ratio = |field: &str| {
            report[field].as_f64().unwrap_or(0.0) / baseline[field].as_f64().unwrap_or(f64::NAN)
        };
        report["ratios"] = json!({
            "put_messages_per_s": ratio("put_messages_per_s"),
            "random_check_gets_per_s": ratio("random_check_gets_per_s"),
            "sequential_check_messages_per_s": ratio("sequential_check_messages_per_s"),
        });
        report["baseline"] = baseline;
    }
    eprintln!(
        "put {:.0} msg/s ({:.1} MB/s, raw disk {:.1} MB/s), {} fsyncs, random check {:.0} gets/s, \
         sequential check {:.0} msg/s, recovery {:.3} s, peak RSS {} MiB",
        report["put_messages_per_s"].as_f64().unwrap_or(0.0),
        report["put_mb_per_s"].as_f64().unwrap_or(0.0),
        raw.best(),
        report["fsyncs"],
        report["random_check_gets_per_s"].as_f64().unwrap_or(0.0),
        report["sequential_check_messages_per_s"]
            .as_f64()
            .unwrap_or(0.0),
        recovery_s,
        super::peak_rss_bytes("self") >> 20,
    );
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// A store's memory in the report: totals, and per queue (buffers included) and per message.
fn memory_json(memory: &MemoryUsage, queues: u64, stored: f64) -> Value {
    json!({
        "total_bytes": memory.total_bytes,
        "index_bytes": memory.index_bytes,
        "buffer_bytes": memory.buffer_bytes,
        "spare_buffer_bytes": memory.spare_buffer_bytes,
        "queue_bytes": memory.queue_bytes,
        "bytes_per_queue": (memory.queue_bytes + memory.buffer_bytes + memory.spare_buffer_bytes)
            as f64
            / queues as f64,
        "index_bytes_per_message": memory.index_bytes as f64 / stored,
    })
}

/// Put, random check (right after the put, then with `directory`'s files in the page cache)
/// and sequential check against `target`, whose files are in `directory`.
fn run_phases(
    args: &StoreBenchArgs,
    target: &dyn BenchTarget,
    directory: &Path,
) -> anyhow::Result<Value> {
    let per_queue = args.messages / args.queues;
    let stored = per_queue * args.queues;
    let fsyncs_before = target.fsyncs();
    let put_started = Instant::now();
    let cpu_before = super::cpu_seconds("self");
    put_phase(args, target, per_queue)?;
    // The put ends when every message is on disk: under `interval` the store would otherwise
    // still be writing the last rounds during the checks, slowing them and flattering the put.
    target.flush()?;
    let put_s = put_started.elapsed().as_secs_f64();
    let put_cpu_s = super::cpu_seconds("self") - cpu_before;
    let fsyncs = target.fsyncs() - fsyncs_before;

    // Right after the put: what direct writes left out of the page cache comes from the disk.
    let random_started = Instant::now();
    random_check(args, target, per_queue, RANDOM_SEED_AFTER_PUT)?;
    let random_after_put_s = random_started.elapsed().as_secs_f64();

    let fill_started = Instant::now();
    let filled_bytes = fill_page_cache(directory)?;
    let fill_s = fill_started.elapsed().as_secs_f64();

    let random_started = Instant::now();
    let random_messages = random_check(args, target, per_queue, 0)?;
    let random_s = random_started.elapsed().as_secs_f64();

    let sequential_started = Instant::now();
    let sequential_messages = sequential_check(args, target, per_queue)?;
    let sequential_s = sequential_started.elapsed().as_secs_f64();
    let put_bytes = stored as f64 * args.message_bytes as f64;
    Ok(json!({
        "bench": "store",
        "queues": args.queues,
        "messages": stored,
        "message_bytes": args.message_bytes,
        "threads": args.threads,
        "sync": args.sync,
        "put_s": put_s,
        "put_messages_per_s": stored as f64 / put_s,
        "put_mb_per_s": put_bytes / put_s / 1e6,
        // The whole process (load generator and store): on a shared machine whose speed varies
        // from run to run, CPU per message moves less than messages per second.
        "put_cpu_s": put_cpu_s,
        "put_cpu_us_per_message": put_cpu_s * 1e6 / stored as f64,
        "fsyncs": fsyncs,
        "random_check_s": random_s,
        "random_check_gets_per_s": args.queues as f64 / random_s,
        "random_check_after_put_s": random_after_put_s,
        "random_check_after_put_gets_per_s": args.queues as f64 / random_after_put_s,
        "page_cache_fill_s": fill_s,
        "page_cache_fill_bytes": filled_bytes,
        "random_check_messages": random_messages,
        "sequential_check_s": sequential_s,
        "sequential_check_messages_per_s": sequential_messages as f64 / sequential_s,
    }))
}

/// What the reopen read: segments, records, log records skipped (before the floor), bytes.
fn recovery_json(open_report: &OpenReport) -> Value {
    json!({
        "segments": open_report.segments,
        "records": open_report.records,
        "log_records_skipped": open_report.log_records_skipped,
        "bytes_scanned": open_report.bytes_scanned,
    })
}

/// Every thread appends to its share of the queues, offset by offset, in batches.
fn put_phase(
    args: &StoreBenchArgs,
    target: &dyn BenchTarget,
    per_queue: u64,
) -> anyhow::Result<()> {
    in_threads(args.threads, |thread| {
        let mut buffer = PutBuffer::default();
        let mut pending: Vec<(u64, u64)> = Vec::with_capacity(PUT_BATCH_MESSAGES);
        for offset in 0..per_queue {
            for queue in (thread as u64..args.queues).step_by(args.threads) {
                pending.push((queue, offset));
                if pending.len() == PUT_BATCH_MESSAGES {
                    put(target, &pending, args.message_bytes, &mut buffer)?;
                    pending.clear();
                }
            }
        }
        put(target, &pending, args.message_bytes, &mut buffer)
    })
}

/// Seeds of the random check right after the put start here (those of the one in the page
/// cache at 0), so the two read different offsets.
const RANDOM_SEED_AFTER_PUT: u64 = 1 << 32;

/// Reads every file under `directory` (and its subdirectories) once, in order, so that a read
/// after it finds the data in the page cache; returns the bytes read.
fn fill_page_cache(directory: &Path) -> anyhow::Result<u64> {
    use std::io::Read;
    let mut buffer = vec![0_u8; 1 << 20];
    let mut read = 0;
    let mut pending = vec![directory.to_path_buf()];
    while let Some(path) = pending.pop() {
        for entry in
            std::fs::read_dir(&path).with_context(|| format!("reading {}", path.display()))?
        {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                pending.push(entry.path());
                continue;
            }
            let mut file = std::fs::File::open(entry.path())?;
            loop {
                let count = file.read(&mut buffer)?;
                if count == 0 {
                    break;
                }
                read += count as u64;
            }
        }
    }
    Ok(read)
}

/// Reads 10 messages from a random offset of every queue; returns the messages checked.
fn random_check(
    args: &StoreBenchArgs,
    target: &dyn BenchTarget,
    per_queue: u64,
    seed: u64,
) -> anyhow::Result<u64> {
    let checked = AtomicU64::new(0);
    in_threads(args.threads, |thread| {
        let mut random = rand::rngs::StdRng::seed_from_u64(seed + thread as u64);
        let mut expected = Vec::new();
        for queue in (thread as u64..args.queues).step_by(args.threads) {
            let count = per_queue.min(10);
            let offset = random.random_range(0..=per_queue - count);
            let messages = read_all(target, queue, offset, count)?;
            verify(
                queue,
                offset,
                &messages,
                count,
                args.message_bytes,
                &mut expected,
            )?;
            checked.fetch_add(count, Ordering::Relaxed);
        }
        Ok(())
    })?;
    Ok(checked.into_inner())
}

/// Reads every fifth queue whole, in order; returns the messages checked.
fn sequential_check(
    args: &StoreBenchArgs,
    target: &dyn BenchTarget,
    per_queue: u64,
) -> anyhow::Result<u64> {
    let checked = AtomicU64::new(0);
    in_threads(args.threads, |thread| {
        let mut expected = Vec::new();
        for queue in (0..args.queues)
            .step_by(5)
            .skip(thread)
            .step_by(args.threads)
        {
            let mut offset = 0;
            while offset < per_queue {
                let count = (per_queue - offset).min(SEQUENTIAL_READ_MESSAGES as u64);
                let messages = read_all(target, queue, offset, count)?;
                verify(
                    queue,
                    offset,
                    &messages,
                    count,
                    args.message_bytes,
                    &mut expected,
                )?;
                offset += count;
            }
            checked.fetch_add(per_queue, Ordering::Relaxed);
        }
        Ok(())
    })?;
    Ok(checked.into_inner())
}

/// Reused buffers of one put thread: every name and message of a batch in two flat vectors.
#[derive(Default)]
struct PutBuffer {
    names: Vec<u8>,
    contents: Vec<u8>,
    ends: Vec<(usize, usize)>,
}

fn put(
    target: &dyn BenchTarget,
    pending: &[(u64, u64)],
    message_bytes: usize,
    buffer: &mut PutBuffer,
) -> anyhow::Result<()> {
    if pending.is_empty() {
        return Ok(());
    }
    buffer.names.clear();
    buffer.contents.clear();
    buffer.ends.clear();
    for &(queue, offset) in pending {
        push_queue_name(queue, &mut buffer.names);
        push_message(queue, offset, message_bytes, &mut buffer.contents);
        buffer
            .ends
            .push((buffer.names.len(), buffer.contents.len()));
    }
    let mut batch: Vec<(&[u8], &[u8])> = Vec::with_capacity(pending.len());
    let (mut name_start, mut content_start) = (0, 0);
    for &(name_end, content_end) in &buffer.ends {
        batch.push((
            &buffer.names[name_start..name_end],
            &buffer.contents[content_start..content_end],
        ));
        (name_start, content_start) = (name_end, content_end);
    }
    target.append_batch(&batch)
}

/// Reads `count` messages from `offset`, calling again after a short read (a store may return
/// fewer messages than asked, for example at a chunk boundary); an empty read is an error.
fn read_all(
    target: &dyn BenchTarget,
    queue: u64,
    offset: u64,
    count: u64,
) -> anyhow::Result<Vec<Vec<u8>>> {
    let name = queue_name(queue);
    let mut messages = Vec::with_capacity(count as usize);
    while (messages.len() as u64) < count {
        let next = offset + messages.len() as u64;
        let read = target.read(&name, next, (count - messages.len() as u64) as usize)?;
        if read.is_empty() {
            bail!(
                "queue {queue}: nothing to read at offset {next}, expected {count} from {offset}"
            );
        }
        messages.extend(read);
    }
    Ok(messages)
}

fn verify(
    queue: u64,
    offset: u64,
    messages: &[Vec<u8>],
    count: u64,
    message_bytes: usize,
    expected: &mut Vec<u8>,
) -> anyhow::Result<()> {
    if messages.len() as u64 != count {
        bail!(
            "queue {queue} offset {offset}: read {} messages, expected {count}",
            messages.len()
        );
    }
    for (index, got) in messages.iter().enumerate() {
        message(queue, offset + index as u64, message_bytes, expected);
        if got != expected {
            bail!(
                "queue {queue} offset {}: the message read differs from the one written",
                offset + index as u64
            );
        }
    }
    Ok(())
}

/// Runs `work(thread)` on `threads` threads and returns the first error.
fn in_threads(
    threads: usize,
    work: impl Fn(usize) -> anyhow::Result<()> + Sync,
) -> anyhow::Result<()> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                let work = &work;
                scope.spawn(move || work(thread))
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| {
                handle
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a thread panicked")))
            })
            .collect::<anyhow::Result<Vec<()>>>()
            .map(|_| ())
    })
}

/// The same disk's sequential write bandwidth, in MB/s: written through the page cache (1 MiB
/// writes) and with `O_DIRECT` (8 MiB writes; `None` where the file system refuses it), each
/// followed by one fsync.
struct RawDisk {
    buffered: f64,
    direct: Option<f64>,
}

impl RawDisk {
    fn probe(directory: &Path, data_bytes: u64) -> anyhow::Result<Self> {
        let bytes = data_bytes.clamp(64 << 20, RAW_PROBE_BYTES_MAX);
        let path = directory.join("raw-write-probe");
        let direct = {
            use std::os::unix::fs::OpenOptionsExt;
            let opened = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path);
            // A file system or device that refuses it (at open or at the first write) has
            // no direct figure; the buffered one stands alone.
            let measured = opened
                .ok()
                .and_then(|file| Self::write(&file, bytes, 8 << 20).ok());
            let _ = std::fs::remove_file(&path);
            measured
        };
        let file = std::fs::File::create(&path)?;
        let buffered = Self::write(&file, bytes, 1 << 20)?;
        drop(file);
        std::fs::remove_file(&path)?;
        Ok(Self { buffered, direct })
    }

    /// Writes `bytes` in blocks of `block` (aligned in memory for `O_DIRECT`), then fsyncs.
    fn write(mut file: &std::fs::File, bytes: u64, block: usize) -> anyhow::Result<f64> {
        const ALIGN: usize = 4096;
        let mut storage = vec![0x5a_u8; block + ALIGN];
        let skip = storage.as_ptr().align_offset(ALIGN);
        let block = &mut storage[skip..skip + block];
        let started = Instant::now();
        let mut written = 0;
        while written < bytes {
            file.write_all(block)?;
            written += block.len() as u64;
        }
        file.sync_all()?;
        Ok(written as f64 / started.elapsed().as_secs_f64() / 1e6)
    }

    /// The faster of the two: what the disk takes.
    fn best(&self) -> f64 {
        self.direct
            .map_or(self.buffered, |direct| direct.max(self.buffered))
    }
}

#[cfg(feature = "baseline")]
fn run_baseline(args: &StoreBenchArgs, root: &Path) -> anyhow::Result<Value> {
    let target = fjall_target::FjallTarget::open(&root.join("fjall"), &args.sync)?;
    let mut report = run_phases(args, &target, &root.join("fjall"))?;
    report["store"] = json!(format!("fjall {}", fjall_target::VERSION));
    Ok(report)
}

#[cfg(not(feature = "baseline"))]
fn run_baseline(_args: &StoreBenchArgs, _root: &Path) -> anyhow::Result<Value> {
    bail!(
        "--baseline needs the baseline store compiled in: cargo build --release -p levee \
         --features baseline"
    )
}

#[cfg(feature = "baseline")]
mod fjall_target {
    //! fjall behind [`BenchTarget`]: one partition, key = queue name, 0x00, offset (big endian).

    use std::path::Path;
    use std::sync::atomic::{AtomicU64, Ordering};

    use fjall::{Config, PartitionCreateOptions, PersistMode};

    use super::BenchTarget;

    pub const VERSION: &str = "2";

    pub struct FjallTarget {
        keyspace: fjall::Keyspace,
        partition: fjall::PartitionHandle,
        sync_always: bool,
        fsyncs: AtomicU64,
    }

    impl FjallTarget {
        pub fn open(path: &Path, sync: &str) -> anyhow::Result<Self> {
            let keyspace = Config::new(path).open()?;
            let partition = keyspace.open_partition("queues", PartitionCreateOptions::default())?;
            Ok(Self {
                keyspace,
                partition,
                sync_always: sync == "always",
                fsyncs: AtomicU64::new(0),
            })
        }
    }

    fn key(queue: &[u8], offset: u64) -> Vec<u8> {
        let mut key = Vec::with_capacity(queue.len() + 9);
        key.extend_from_slice(queue);
        key.push(0);
        key.extend_from_slice(&offset.to_be_bytes());
        key
    }

    impl BenchTarget for FjallTarget {
        fn append_batch(&self, batch: &[(&[u8], &[u8])]) -> anyhow::Result<()> {
            // The benchmark knows each queue's next offset from the message itself (bytes 8..16).
            let mut write = self.keyspace.batch();
            for (queue, message) in batch {
                let offset = u64::from_le_bytes(message[8..16].try_into()?);
                write.insert(&self.partition, key(queue, offset), *message);
            }
            write.commit()?;
            if self.sync_always {
                self.keyspace.persist(PersistMode::SyncAll)?;
                self.fsyncs.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        }

        fn read(&self, queue: &[u8], offset: u64, count: usize) -> anyhow::Result<Vec<Vec<u8>>> {
            let mut end = queue.to_vec();
            end.push(1);
            self.partition
                .range(key(queue, offset)..end)
                .take(count)
                .map(|item| Ok(item?.1.to_vec()))
                .collect()
        }

        fn flush(&self) -> anyhow::Result<()> {
            self.keyspace.persist(PersistMode::SyncAll)?;
            self.fsyncs.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }

        fn fsyncs(&self) -> u64 {
            self.fsyncs.load(Ordering::Relaxed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn given_queue_numbers_then_names_match_the_formatted_ones() {
        for queue in [
            0,
            7,
            12_345_678,
            99_999_999,
            100_000_000,
            123_456_789_012,
            u64::MAX,
        ] {
            assert_eq!(
                queue_name(queue),
                format!("q{queue:08}").into_bytes(),
                "{queue}"
            );
        }
    }

    #[test]
    fn given_a_queue_and_offset_then_the_message_repeats_its_seed() {
        for (queue, offset, bytes) in [(0, 0, 16), (3, 9, 58), (123_456, 77, 61), (1, 2, 4096)] {
            let mut message_bytes = Vec::new();
            message(queue, offset, bytes, &mut message_bytes);
            let seed = queue.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ offset;
            let mut expected = queue.to_le_bytes().to_vec();
            expected.extend_from_slice(&offset.to_le_bytes());
            expected.extend((0..bytes - 16).map(|index| seed.to_le_bytes()[index % 8]));
            assert_eq!(message_bytes, expected);
        }
    }
}
