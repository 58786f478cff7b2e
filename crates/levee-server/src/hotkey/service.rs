//! The `levee.v1.HotKeys` gRPC service: app-server sessions and the admin calls.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_util::Stream;
use levee_proto::WireError;
use levee_proto::v1::hot_key_client_message::Kind as ClientKind;
use levee_proto::v1::hot_key_server_message::Kind as ServerKind;
use levee_proto::v1::hot_keys_server::HotKeys;
use levee_proto::v1::{
    ErrorCode, EventBatch, GetAppStatsRequest, GetAppStatsResponse, GetRulesRequest,
    GetRulesResponse, HotKeyClientMessage, HotKeyServerMessage, KeyCount, ListAppsRequest,
    ListAppsResponse, ListHotKeysRequest, ListHotKeysResponse, RemoveHotKeyRequest,
    RemoveHotKeyResponse, SetHotKeyRequest, SetHotKeyResponse, SetRulesRequest, SetRulesResponse,
    Snapshot, TopKeysRequest, TopKeysResponse,
};
use tokio::sync::{broadcast, oneshot, watch};
use tonic::{Request, Response, Status, Streaming};

use super::admin::HotKeyAdmin;
use super::convert::{rule_from_wire, rule_to_wire};
use super::hub::{ClientGuard, HotKeyHub};
use crate::metrics::Metrics;

/// Most events in one message to an app server (a batch that alone is larger goes whole).
const EVENTS_PER_MESSAGE_MAX: usize = 4_096;
/// How long a new session may take to send its Hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Implements `levee.v1.HotKeys` over a [`HotKeyHub`].
#[derive(Debug, Clone)]
pub struct HotKeyService {
    hub: Arc<HotKeyHub>,
    admin: HotKeyAdmin,
    metrics: Metrics,
    closing: watch::Receiver<bool>,
}

impl HotKeyService {
    /// A service over `admin`'s hub; sessions end when `closing` turns true (server
    /// shutdown).
    pub fn new(admin: HotKeyAdmin, metrics: Metrics, closing: watch::Receiver<bool>) -> Self {
        Self {
            hub: Arc::clone(admin.hub()),
            admin,
            metrics,
            closing,
        }
    }
}

type SessionStream = Pin<Box<dyn Stream<Item = Result<HotKeyServerMessage, Status>> + Send>>;

/// The state of one session's outgoing stream.
struct Outgoing {
    hub: Arc<HotKeyHub>,
    metrics: Metrics,
    app: String,
    pending_snapshot: Option<Snapshot>,
    receiver: broadcast::Receiver<Arc<EventBatch>>,
    closing: watch::Receiver<bool>,
    /// Fires (or is dropped) when the app server's side of the session ends.
    reports_ended: oneshot::Receiver<Status>,
    done: bool,
    _guard: ClientGuard,
}

impl Outgoing {
    async fn next(mut self) -> Option<(Result<HotKeyServerMessage, Status>, Self)> {
        loop {
            if self.done {
                return None;
            }
            if let Some(snapshot) = self.pending_snapshot.take() {
                self.metrics
                    .hotkey_events_delivered
                    .inc_by(snapshot.hot.len() as u64);
                let message = HotKeyServerMessage {
                    kind: Some(ServerKind::Snapshot(snapshot)),
                };
                return Some((Ok(message), self));
            }
            let mut closing = self.closing.clone();
            tokio::select! {
                ended = &mut self.reports_ended => {
                    self.done = true;
                    return match ended {
                        Ok(status) => Some((Err(status), self)),
                        Err(_) => None,
                    };
                }
                _ = closing.wait_for(|closing| *closing) => {
                    self.done = true;
                    let status = Status::from(WireError::new(
                        ErrorCode::Unavailable,
                        "server shutting down; reconnect to another server",
                    ));
                    return Some((Err(status), self));
                }
                received = self.receiver.recv() => match received {
                    Ok(batch) => {
                        let batch = self.coalesce(&batch);
                        self.metrics.hotkey_events_delivered.inc_by(batch.events.len() as u64);
                        let message = HotKeyServerMessage { kind: Some(ServerKind::Events(batch)) };
                        return Some((Ok(message), self));
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        // Too far behind: a fresh snapshot replaces what was missed.
                        self.metrics.hotkey_resyncs.inc();
                        self.pending_snapshot = Some(Snapshot { hot: self.hub.snapshot(&self.app) });
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
            }
        }
    }
}

impl Outgoing {
    /// `first` plus the batches already waiting behind it, as one message of at most
    /// [`EVENTS_PER_MESSAGE_MAX`] events: an app server that is a little behind catches up in
    /// fewer, larger writes. Events keep their order.
    fn coalesce(&mut self, first: &EventBatch) -> EventBatch {
        let mut events = first.events.clone();
        while events.len() < EVENTS_PER_MESSAGE_MAX {
            match self.receiver.try_recv() {
                Ok(next) => events.extend(next.events.iter().cloned()),
                Err(broadcast::error::TryRecvError::Lagged(_)) => {
                    // Missed batches: deliver what we have, then a fresh snapshot.
                    self.metrics.hotkey_resyncs.inc();
                    self.pending_snapshot = Some(Snapshot {
                        hot: self.hub.snapshot(&self.app),
                    });
                    break;
                }
                Err(_) => break,
            }
        }
        EventBatch { events }
    }
}

/// Reads one session's report batches until the app server hangs up or breaks the protocol.
async fn read_reports(
    hub: Arc<HotKeyHub>,
    app: String,
    mut incoming: Streaming<HotKeyClientMessage>,
    ended: oneshot::Sender<Status>,
) {
    loop {
        let message = match incoming.message().await {
            Ok(Some(message)) => message,
            Ok(None) => return,
            Err(status) => {
                // A message over the size limit, or a broken stream: the session ends with
                // a Levee error (never as if the client had hung up).
                let error = WireError::from_transport(&status);
                tracing::warn!(%app, %error, "hot-key session's report stream failed");
                let _ = ended.send(error.into());
                return;
            }
        };
        match message.kind {
            Some(ClientKind::Report(batch)) => {
                let keys: Vec<(&[u8], u32)> = batch
                    .keys
                    .iter()
                    .map(|report| (report.key.as_slice(), report.count))
                    .collect();
                if let Err(error) = hub.report(&app, &keys) {
                    tracing::warn!(%app, %error, "hot-key report refused; ending the session");
                    let _ = ended.send(error.into());
                    return;
                }
            }
            Some(ClientKind::Hello(_)) | None => {
                tracing::warn!(%app, "hot-key session sent a second hello or an empty message");
            }
        }
    }
}

fn invalid(message: String) -> Status {
    WireError::new(ErrorCode::InvalidArgument, message).into()
}

#[tonic::async_trait]
impl HotKeys for HotKeyService {
    type SessionStream = SessionStream;

    async fn session(
        &self,
        request: Request<Streaming<HotKeyClientMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut incoming = request.into_inner();
        let hello = match tokio::time::timeout(HELLO_TIMEOUT, incoming.message()).await {
            Ok(Ok(Some(HotKeyClientMessage {
                kind: Some(ClientKind::Hello(hello)),
            }))) => hello,
            Ok(Err(status)) => return Err(status),
            Err(_) => {
                return Err(invalid(format!(
                    "no hello within {} s; send Hello first",
                    HELLO_TIMEOUT.as_secs()
                )));
            }
            Ok(Ok(_)) => return Err(invalid("the first message must be a Hello".to_owned())),
        };
        self.hub.check_app(&hello.app)?;
        tracing::debug!(app = %hello.app, client = %hello.client_id, "hot-key session opened");
        let subscription = self.hub.subscribe(&hello.app)?;
        let (ended, reports_ended) = oneshot::channel();
        tokio::spawn(read_reports(
            Arc::clone(&self.hub),
            hello.app.clone(),
            incoming,
            ended,
        ));
        let outgoing = Outgoing {
            hub: Arc::clone(&self.hub),
            metrics: self.metrics.clone(),
            app: hello.app,
            pending_snapshot: Some(Snapshot {
                hot: subscription.snapshot,
            }),
            receiver: subscription.receiver,
            closing: self.closing.clone(),
            reports_ended,
            done: false,
            _guard: subscription.guard,
        };
        let stream = futures_util::stream::unfold(outgoing, Outgoing::next);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn set_rules(
        &self,
        request: Request<SetRulesRequest>,
    ) -> Result<Response<SetRulesResponse>, Status> {
        let request = request.into_inner();
        let rules = request
            .rules
            .iter()
            .map(rule_from_wire)
            .collect::<Result<Vec<_>, _>>()?;
        self.admin.set_rules(&request.app, &rules).await?;
        Ok(Response::new(SetRulesResponse {}))
    }

    async fn get_rules(
        &self,
        request: Request<GetRulesRequest>,
    ) -> Result<Response<GetRulesResponse>, Status> {
        let rules = self.admin.rules(&request.into_inner().app).await?;
        Ok(Response::new(GetRulesResponse {
            rules: rules.iter().map(rule_to_wire).collect(),
        }))
    }

    async fn list_apps(
        &self,
        _request: Request<ListAppsRequest>,
    ) -> Result<Response<ListAppsResponse>, Status> {
        Ok(Response::new(ListAppsResponse {
            apps: self.admin.apps().await?,
        }))
    }

    async fn set_hot_key(
        &self,
        request: Request<SetHotKeyRequest>,
    ) -> Result<Response<SetHotKeyResponse>, Status> {
        let request = request.into_inner();
        self.admin
            .set_manual_hot(&request.app, &request.key, request.duration_ms)
            .await?;
        Ok(Response::new(SetHotKeyResponse {}))
    }

    async fn remove_hot_key(
        &self,
        request: Request<RemoveHotKeyRequest>,
    ) -> Result<Response<RemoveHotKeyResponse>, Status> {
        let request = request.into_inner();
        let was_hot = self.admin.remove_hot(&request.app, &request.key).await?;
        Ok(Response::new(RemoveHotKeyResponse { was_hot }))
    }

    async fn list_hot_keys(
        &self,
        request: Request<ListHotKeysRequest>,
    ) -> Result<Response<ListHotKeysResponse>, Status> {
        Ok(Response::new(ListHotKeysResponse {
            hot: self.hub.snapshot(&request.into_inner().app),
        }))
    }

    async fn top_keys(
        &self,
        request: Request<TopKeysRequest>,
    ) -> Result<Response<TopKeysResponse>, Status> {
        let request = request.into_inner();
        let keys = self.hub.top_keys(&request.app, request.limit as usize)?;
        Ok(Response::new(TopKeysResponse {
            keys: keys
                .into_iter()
                .map(|key| KeyCount {
                    key: key.key,
                    count: key.count,
                })
                .collect(),
        }))
    }

    async fn get_app_stats(
        &self,
        request: Request<GetAppStatsRequest>,
    ) -> Result<Response<GetAppStatsResponse>, Status> {
        let (stats, clients) = self.hub.stats(&request.into_inner().app)?;
        Ok(Response::new(GetAppStatsResponse {
            hits_received: stats.hits_received,
            reports_received: stats.reports_received,
            hot_detected: stats.hot_detected,
            hot_now: stats.hot_now,
            keys_tracked: stats.keys_tracked,
            clients_connected: clients,
        }))
    }
}
