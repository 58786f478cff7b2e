//! The `levee.v1.Admin` gRPC service: server information and a diagnostic echo.

use std::sync::Arc;
use std::time::Duration;

use levee_proto::WireError;
use levee_proto::v1::admin_server::Admin;
use levee_proto::v1::{
    EchoRequest, EchoResponse, ErrorCode, GetServerInfoRequest, GetServerInfoResponse,
};
use tonic::{Request, Response, Status};

use crate::state::ServerState;

/// Largest payload [`Admin::echo`] accepts.
pub const ECHO_PAYLOAD_BYTES_MAX: usize = 65_536;
/// Longest delay [`Admin::echo`] accepts.
pub const ECHO_DELAY_MS_MAX: u32 = 60_000;

/// Implements the Admin service over the shared server state.
#[derive(Debug, Clone)]
pub struct AdminService {
    state: Arc<ServerState>,
}

impl AdminService {
    /// A service answering from `state`.
    pub fn new(state: Arc<ServerState>) -> Self {
        Self { state }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn get_server_info(
        &self,
        _request: Request<GetServerInfoRequest>,
    ) -> Result<Response<GetServerInfoResponse>, Status> {
        let state = &self.state;
        Ok(Response::new(GetServerInfoResponse {
            version: env!("CARGO_PKG_VERSION").to_owned(),
            grpc_addr: state.grpc_addr.to_string(),
            admin_addr: state.admin_addr.to_string(),
            data_dir: state.data_dir.display().to_string(),
            uptime_ms: state.uptime_ms(),
            process_id: std::process::id(),
            process_cpu_seconds: crate::metrics::process_cpu_seconds(),
            resident_memory_bytes: crate::metrics::process_resident_memory_bytes()
                .map_or(0, |bytes| u64::try_from(bytes).unwrap_or(0)),
        }))
    }

    async fn echo(&self, request: Request<EchoRequest>) -> Result<Response<EchoResponse>, Status> {
        let request = request.into_inner();
        if request.payload.len() > ECHO_PAYLOAD_BYTES_MAX {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "payload: at most {ECHO_PAYLOAD_BYTES_MAX} bytes, got {}; send a smaller \
                     payload",
                    request.payload.len()
                ),
            )
            .into());
        }
        if request.delay_ms > ECHO_DELAY_MS_MAX {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "delay_ms: at most {ECHO_DELAY_MS_MAX}, got {}; ask for a shorter delay",
                    request.delay_ms
                ),
            )
            .into());
        }
        if request.delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(u64::from(request.delay_ms))).await;
        }
        Ok(Response::new(EchoResponse {
            payload: request.payload,
        }))
    }
}
