//! The admin HTTP port: `/healthz` (the process is up), `/readyz` (ready to serve), `/metrics`
//! (Prometheus) and `/v1/server` (the server's facts as JSON).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json};
use axum::routing::get;

use crate::metrics::CONTENT_TYPE;
use crate::state::ServerState;

/// The admin router over the shared state.
pub fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/server", get(server))
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<Arc<ServerState>>) -> (StatusCode, &'static str) {
    if state.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: starting or shutting down\n",
        )
    }
}

async fn metrics(State(state): State<Arc<ServerState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, CONTENT_TYPE)],
        state.metrics.encode(),
    )
}

async fn server(State(state): State<Arc<ServerState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "grpc_addr": state.grpc_addr.to_string(),
        "admin_addr": state.admin_addr.to_string(),
        "data_dir": state.data_dir.display().to_string(),
        "cluster_id": state.cluster.cluster_id,
        "node_id": state.cluster.node_id,
        "uptime_ms": state.uptime_ms(),
        "process_id": std::process::id(),
        "ready": state.is_ready(),
    }))
}
