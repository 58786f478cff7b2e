//! `levee bench queue --against redis`: the same shape against Redis Streams, the baseline the
//! queue issue names. The tool starts `redis-server` (from the system, e.g. Debian's package) on
//! a free loopback port with a fresh directory, AOF on and `appendfsync always` for `--sync
//! always` or `everysec` for `--sync interval` (Redis has nothing shorter; Levee's interval is
//! `--interval-ms`, 10 ms by default, the stricter of the two). One stream per queue or partition; producers XADD
//! (pipelined `--batch` at a time in the topic shape, one command per send in the mailbox
//! shape); consumers read with XREADGROUP (one group, `--consumers` consumers for the topic
//! shape, 16 for the mailbox shape, each over its share of the streams) and XACK what they read.
//! Latency is measured the same way: from the send time stamped in the payload to the read.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use redis::AsyncCommands;
use redis::streams::{StreamReadOptions, StreamReadReply};
use serde_json::{Value, json};

use super::queue::{
    DRAIN_LIMIT, Latencies, QueueBenchArgs, drain, next_send, pacing, produce_for, stamped_payload,
};

/// The consumer group every reader joins.
const GROUP: &str = "bench";
/// Most entries one XREADGROUP returns.
const READ_COUNT: usize = 1_000;
/// How long one reply may take.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most streams one XREADGROUP names: a reader goes round its share this many at a time (one
/// command naming tens of thousands of streams costs Redis every one of them per call).
const READ_WINDOW: usize = 1_000;
/// Streams created per pipelined request.
const SETUP_PIPELINE: usize = 10_000;
/// Reader connections in the mailbox shape (one per queue would mean a thousand connections).
const MAILBOX_READERS: u64 = 16;

/// A `redis-server` child, stopped when dropped.
struct RedisProcess {
    child: Child,
    port: u16,
    _directory: tempfile::TempDir,
}

impl RedisProcess {
    fn start(appendfsync: &str) -> anyhow::Result<Self> {
        let directory = tempfile::tempdir()?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args([
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                appendfsync,
            ])
            .arg("--dir")
            .arg(directory.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context(
                "cannot start redis-server; install it (apt-get install redis-server) to run \
                 --against redis",
            )?;
        Ok(Self {
            child,
            port,
            _directory: directory,
        })
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A connection whose replies may take up to [`RESPONSE_TIMEOUT`] (the client's default, 500
/// ms, is too short for a pipeline of thousands of commands on a busy server).
async fn open(client: &redis::Client) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let config = redis::AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

/// A connection once the server answers PING (it may take a moment to start).
async fn connect(
    client: &redis::Client,
    port: u16,
) -> anyhow::Result<redis::aio::MultiplexedConnection> {
    for _ in 0..100 {
        if let Ok(mut opened) = open(client).await
            && redis::cmd("PING")
                .query_async::<String>(&mut opened)
                .await
                .is_ok()
        {
            return Ok(opened);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("redis-server did not answer on port {port} within 5 s")
}

/// Creates the streams, each with the readers' group.
async fn create_streams(
    connection: &mut redis::aio::MultiplexedConnection,
    streams: &[String],
) -> anyhow::Result<()> {
    let setting_up = Instant::now();
    // Pipelined: a million one-by-one round trips would take longer than the run.
    for chunk in streams.chunks(SETUP_PIPELINE) {
        let mut pipe = redis::pipe();
        for stream in chunk {
            pipe.cmd("XGROUP")
                .arg("CREATE")
                .arg(stream)
                .arg(GROUP)
                .arg("$")
                .arg("MKSTREAM")
                .ignore();
        }
        let () = pipe.query_async(connection).await?;
    }
    eprintln!(
        "redis: {} streams with their group created in {:.1} s",
        streams.len(),
        setting_up.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Runs the shape against a fresh Redis and returns the same fields as Levee's report.
pub async fn run(args: &QueueBenchArgs) -> anyhow::Result<Value> {
    let appendfsync = if args.sync == "always" {
        "always"
    } else {
        "everysec"
    };
    let process = RedisProcess::start(appendfsync)?;
    let client = redis::Client::open(format!("redis://127.0.0.1:{}/", process.port))?;
    let mut connection = connect(&client, process.port).await?;
    let topic = args.shape == "topic";
    let stream_count = if topic {
        u64::from(args.partitions)
    } else {
        args.queues
    };
    let streams: Vec<String> = (0..stream_count)
        .map(|index| format!("bench:{index}"))
        .collect();
    create_streams(&mut connection, &streams).await?;
    let epoch = Instant::now();
    let consumed = Arc::new(AtomicU64::new(0));
    let latency = Latencies::new()?;
    let stop_readers = Arc::new(AtomicBool::new(false));
    let readers = if topic {
        args.consumers
    } else {
        MAILBOX_READERS.min(stream_count)
    };
    let mut reader_tasks = Vec::new();
    for reader in 0..readers {
        let share: Vec<String> = streams
            .iter()
            .enumerate()
            .filter(|(index, _)| topic || *index as u64 % readers == reader)
            .map(|(_, stream)| stream.clone())
            .collect();
        let connection = open(&client).await?;
        let (consumed, latency, stop) = (
            Arc::clone(&consumed),
            Arc::clone(&latency),
            Arc::clone(&stop_readers),
        );
        reader_tasks.push(tokio::spawn(read_loop(
            connection,
            format!("reader-{reader}"),
            share,
            epoch,
            consumed,
            latency,
            stop,
        )));
    }
    let started = Instant::now();
    latency.start(epoch, args.warmup_s)?;
    let stop = Arc::new(AtomicBool::new(false));
    let appended = Arc::new(AtomicU64::new(0));
    // Shared, not copied per producer task (a thousand copies of a million names would not fit).
    let shared: Arc<[String]> = streams.into();
    let tasks = spawn_producers(
        args,
        &connection,
        &shared,
        epoch,
        &stop,
        &appended,
        &latency,
    );
    let append_s = produce_for(args, started, &stop, tasks).await?;
    let total = appended.load(Ordering::Relaxed);
    // Redis may fall far behind (an XREADGROUP costs every stream it names): what it consumed
    // within the limit is reported, not an error.
    let drained = drain(&consumed, total).await;
    if !drained {
        eprintln!(
            "redis: consumed {} of {total} within {} s of the producers stopping",
            consumed.load(Ordering::Relaxed),
            DRAIN_LIMIT.as_secs()
        );
    }
    let drained_s = started.elapsed().as_secs_f64();
    let handled = consumed.load(Ordering::Relaxed);
    stop_readers.store(true, Ordering::Relaxed);
    for reader in reader_tasks {
        reader.await??;
    }
    let mut report = json!({
        "system": format!("redis-server (AOF appendfsync {appendfsync})"),
        "streams": stream_count,
        "readers": readers,
        "duration_s": append_s,
        "warmup_s": args.warmup_s,
        "appended": total,
        "appends_per_s": total as f64 / append_s,
        "consumed": handled,
        "consumed_per_s": handled as f64 / drained_s,
        "drained": drained,
    });
    latency.report(&mut report);
    Ok(report)
}

/// Producer tasks XADDing to `streams` until `stop`.
fn spawn_producers(
    args: &QueueBenchArgs,
    connection: &redis::aio::MultiplexedConnection,
    streams: &Arc<[String]>,
    epoch: Instant,
    stop: &Arc<AtomicBool>,
    appended: &Arc<AtomicU64>,
    latency: &Arc<Latencies>,
) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let topic = args.shape == "topic";
    let producers = args.producer_tasks();
    let unit = if topic { args.batch } else { 1 };
    let mut tasks = Vec::new();
    for task in 0..producers {
        let mut connection = connection.clone();
        let (stop, appended, streams, latency) = (
            Arc::clone(stop),
            Arc::clone(appended),
            Arc::clone(streams),
            Arc::clone(latency),
        );
        let mut pace = pacing(args, task, producers, unit);
        let (bytes, partitions) = (args.message_bytes, args.partitions);
        tasks.push(tokio::spawn(async move {
            let mut index = task;
            let mut key = task * 1_000_000_007;
            while !stop.load(Ordering::Relaxed) {
                let lag = next_send(&mut pace).await;
                latency.record_send_lag(epoch, lag)?;
                let mut pipe = redis::pipe();
                let mut first = None;
                for _ in 0..unit {
                    let stream = if topic {
                        key += 1;
                        let partition =
                            levee_client::topic_partition(&key.to_le_bytes(), partitions);
                        &streams[partition as usize]
                    } else {
                        index += 1;
                        &streams[(index % streams.len() as u64) as usize]
                    };
                    let payload = stamped_payload(epoch, bytes)?;
                    first.get_or_insert_with(|| payload.clone());
                    pipe.cmd("XADD").arg(stream).arg("*").arg("p").arg(payload);
                }
                let _: Vec<String> = pipe.query_async(&mut connection).await?;
                if let Some(first) = &first {
                    latency.record_append(epoch, first)?;
                }
                appended.fetch_add(unit as u64, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    tasks
}

/// One reader: XREADGROUP over its streams, record each entry's latency, XACK them.
async fn read_loop(
    mut connection: redis::aio::MultiplexedConnection,
    name: String,
    streams: Vec<String>,
    epoch: Instant,
    consumed: Arc<AtomicU64>,
    latency: Arc<Latencies>,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let read_options = || {
        StreamReadOptions::default()
            .group(GROUP, &name)
            .count(READ_COUNT)
    };
    let (options, blocking) = (read_options(), read_options().block(100));
    let windows: Vec<&[String]> = streams.chunks(READ_WINDOW).collect();
    let ids: Vec<&str> = vec![">"; READ_WINDOW.min(streams.len())];
    let (mut window, mut empty_windows) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        let keys = windows[window];
        window = (window + 1) % windows.len();
        // Blocks only once a whole pass over the streams found nothing.
        let options = if empty_windows >= windows.len() {
            &blocking
        } else {
            &options
        };
        let reply: Option<StreamReadReply> = connection
            .xread_options(keys, &ids[..keys.len()], options)
            .await?;
        if reply.as_ref().is_none_or(|reply| reply.keys.is_empty()) {
            empty_windows += 1;
        } else {
            empty_windows = 0;
        }
        let Some(reply) = reply else { continue };
        let mut acks = redis::pipe();
        let mut read = 0;
        for key in reply.keys {
            let mut entry_ids = Vec::with_capacity(key.ids.len());
            for entry in key.ids {
                let payload: Vec<u8> = entry.get("p").context("an entry without its payload")?;
                latency.record(epoch, &payload)?;
                entry_ids.push(entry.id);
                read += 1;
            }
            acks.cmd("XACK").arg(&key.key).arg(GROUP).arg(entry_ids);
        }
        if read > 0 {
            let _: Vec<u64> = acks.query_async(&mut connection).await?;
            consumed.fetch_add(read, Ordering::Relaxed);
        }
    }
    Ok(())
}
