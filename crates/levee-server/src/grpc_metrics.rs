//! A tower layer that counts every gRPC call by method and status code and records its latency,
//! and gives every error status a Levee code on its way out ([`crate::grpc_status`]).
//!
//! A call's status is in the response headers (a trailers-only response, as for most errors) or
//! in the trailers at the end of the body; the layer wraps the body to see the trailers, so
//! streaming calls are measured until their last frame. A call whose body is dropped before the
//! trailers (the client went away) counts as `CANCELLED`. A call answered `UNIMPLEMENTED` counts
//! under the method `unknown`, so made-up paths cannot grow the label set without bound.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::metrics::{Metrics, RequestLabels, RpcLabels};

const GRPC_STATUS_HEADER: &str = "grpc-status";
const UNKNOWN_RPC: &str = "unknown";

/// Adds [`GrpcMetricsService`] around a gRPC router.
#[derive(Debug, Clone)]
pub struct GrpcMetricsLayer {
    metrics: Metrics,
}

impl GrpcMetricsLayer {
    /// A layer that records into `metrics`.
    pub fn new(metrics: Metrics) -> Self {
        Self { metrics }
    }
}

impl<S> tower::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetricsService {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct GrpcMetricsService<S> {
    inner: S,
    metrics: Metrics,
}

impl<S, RequestBody, ResponseBody> tower::Service<http::Request<RequestBody>>
    for GrpcMetricsService<S>
where
    S: tower::Service<http::Request<RequestBody>, Response = http::Response<ResponseBody>>,
    ResponseBody: Body,
{
    type Response = http::Response<MeasuredBody<ResponseBody>>;
    type Error = S::Error;
    type Future = MeasuredFuture<S::Future>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, request: http::Request<RequestBody>) -> Self::Future {
        let call = CallRecord {
            metrics: self.metrics.clone(),
            rpc: request.uri().path().to_owned(),
            start: Instant::now(),
            finished: false,
        };
        MeasuredFuture {
            inner: self.inner.call(request),
            call: Some(call),
        }
    }
}

pin_project! {
    /// The response future of [`GrpcMetricsService`].
    pub struct MeasuredFuture<F> {
        #[pin]
        inner: F,
        call: Option<CallRecord>,
    }
}

impl<F, ResponseBody, E> Future for MeasuredFuture<F>
where
    F: Future<Output = Result<http::Response<ResponseBody>, E>>,
    ResponseBody: Body,
{
    type Output = Result<http::Response<MeasuredBody<ResponseBody>>, E>;

    fn poll(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let result = ready!(this.inner.poll(context));
        let Some(mut call) = this.call.take() else {
            // Polled again after completion: a caller bug that tower forbids.
            return Poll::Pending;
        };
        Poll::Ready(match result {
            Ok(mut response) => {
                crate::grpc_status::complete(response.headers_mut());
                let status_in_headers = response.headers().get(GRPC_STATUS_HEADER).map(status_of);
                let pending = match status_in_headers {
                    Some(code) => {
                        call.finish(code);
                        None
                    }
                    None if response.status() != http::StatusCode::OK => {
                        call.finish(2); // UNKNOWN: not a gRPC response at all.
                        None
                    }
                    None => Some(call),
                };
                Ok(response.map(|inner| MeasuredBody {
                    inner,
                    call: pending,
                }))
            }
            Err(error) => {
                call.finish(13); // INTERNAL: the service itself failed.
                Err(error)
            }
        })
    }
}

pin_project! {
    /// A response body that records its call when the trailers pass through.
    pub struct MeasuredBody<B> {
        #[pin]
        inner: B,
        call: Option<CallRecord>,
    }
}

impl<B: Body> Body for MeasuredBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let mut frame = ready!(this.inner.poll_frame(context));
        match &mut frame {
            Some(Ok(frame)) => {
                if let Some(trailers) = frame.trailers_mut() {
                    crate::grpc_status::complete(trailers);
                    if let Some(mut call) = this.call.take() {
                        call.finish(trailers.get(GRPC_STATUS_HEADER).map_or(2, status_of));
                    }
                }
            }
            Some(Err(_)) => {
                if let Some(mut call) = this.call.take() {
                    call.finish(13);
                }
            }
            None => {
                if let Some(mut call) = this.call.take() {
                    call.finish(2); // The body ended without trailers.
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// One call in progress; records itself as `CANCELLED` if dropped unfinished.
#[derive(Debug)]
struct CallRecord {
    metrics: Metrics,
    rpc: String,
    start: Instant,
    finished: bool,
}

impl CallRecord {
    fn finish(&mut self, code: i32) {
        self.finished = true;
        let rpc = if code == 12 {
            UNKNOWN_RPC.to_owned()
        } else {
            std::mem::take(&mut self.rpc)
        };
        self.metrics
            .grpc_request_duration_seconds
            .get_or_create(&RpcLabels { rpc: rpc.clone() })
            .observe(self.start.elapsed().as_secs_f64());
        self.metrics
            .grpc_requests
            .get_or_create(&RequestLabels {
                rpc,
                code: code_name(code),
            })
            .inc();
    }
}

impl Drop for CallRecord {
    fn drop(&mut self) {
        if !self.finished {
            self.finish(1);
        }
    }
}

fn status_of(value: &http::HeaderValue) -> i32 {
    value
        .to_str()
        .ok()
        .and_then(|text| text.parse().ok())
        .unwrap_or(2)
}

/// The canonical name of a gRPC status code.
pub fn code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "CANCELLED",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        6 => "ALREADY_EXISTS",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        9 => "FAILED_PRECONDITION",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "UNKNOWN",
    }
}
