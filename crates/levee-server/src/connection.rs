//! Accepted gRPC connections: capped by a semaphore (more wait in the kernel's accept queue,
//! which is back-pressure, not an error) and counted in the `connections open` gauge for exactly
//! as long as they live.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::metrics::Metrics;

/// Pause after a failed `accept` (such as running out of file descriptors) before trying again.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// A stream of accepted connections, at most `connections_max` alive at once.
pub fn accept_connections(
    listener: TcpListener,
    connections_max: u32,
    metrics: Metrics,
) -> impl Stream<Item = io::Result<CountedConnection>> {
    let permits = Arc::new(Semaphore::new(connections_max as usize));
    futures_util::stream::unfold(
        (listener, permits, metrics),
        |(listener, permits, metrics)| async move {
            // The semaphore is never closed, so acquiring only waits.
            let permit = Arc::clone(&permits).acquire_owned().await.ok()?;
            loop {
                match listener.accept().await {
                    Ok((stream, _peer)) => {
                        // Small frames must not wait for Nagle's algorithm.
                        let _ = stream.set_nodelay(true);
                        metrics.grpc_connections_accepted.inc();
                        metrics.grpc_connections_open.inc();
                        let connection = CountedConnection {
                            stream,
                            _permit: permit,
                            metrics: metrics.clone(),
                        };
                        return Some((Ok(connection), (listener, permits, metrics)));
                    }
                    Err(error) => {
                        metrics.grpc_accept_errors.inc();
                        tracing::warn!(%error, "accepting a gRPC connection failed; retrying");
                        tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    }
                }
            }
        },
    )
}

/// A TCP connection that holds one connection permit and the gauge until dropped.
#[derive(Debug)]
pub struct CountedConnection {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    metrics: Metrics,
}

impl Drop for CountedConnection {
    fn drop(&mut self) {
        self.metrics.grpc_connections_open.dec();
    }
}

impl Connected for CountedConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for CountedConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(context, buffer)
    }
}

impl AsyncWrite for CountedConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(context, buffer)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffers: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(context, buffers)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(context)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(context)
    }
}
