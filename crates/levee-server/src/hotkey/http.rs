//! The hot-key admin API as JSON on the admin HTTP port, under `/v1/hotkeys`. Keys travel as
//! `key` (text) or, when they are not UTF-8, `key_hex`.

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::response::Json;
use axum::routing::get;
use levee_proto::WireError;
use levee_proto::v1::{ErrorCode, HotKeyEvent};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::api_error::ApiError;

use levee_proto::json::{RuleRecord, key_from_hex, key_hex, key_text};

use super::admin::HotKeyAdmin;
use super::convert::{rule_from_record, rule_to_record};

/// The `/v1/hotkeys` routes.
pub fn router(admin: HotKeyAdmin) -> Router {
    Router::new()
        .route("/v1/hotkeys/apps", get(list_apps))
        .route(
            "/v1/hotkeys/apps/{app}/rules",
            get(get_rules).put(put_rules),
        )
        .route(
            "/v1/hotkeys/apps/{app}/hot",
            get(list_hot).post(set_hot).delete(remove_hot),
        )
        .route("/v1/hotkeys/apps/{app}/top", get(top_keys))
        .route("/v1/hotkeys/apps/{app}/stats", get(stats))
        .with_state(admin)
}

fn bad_request(message: String) -> ApiError {
    ApiError(WireError::new(ErrorCode::InvalidArgument, message))
}

fn key_json(key: &[u8]) -> (&'static str, Value) {
    match key_text(key) {
        Some(text) => ("key", json!(text)),
        None => ("key_hex", json!(key_hex(key))),
    }
}

fn event_json(event: &HotKeyEvent) -> Value {
    let (name, key) = key_json(&event.key);
    let mut value = json!({
        "hot_for_ms": event.hot_for_ms,
        "hot_until_unix_ms": event.hot_until_unix_ms,
        "count": event.count,
        "source": if event.source == levee_proto::v1::HotKeySource::Manual as i32 {
            "manual"
        } else {
            "detected"
        },
    });
    value[name] = key;
    value
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyParameter {
    key: Option<String>,
    key_hex: Option<String>,
}

impl KeyParameter {
    fn bytes(&self) -> Result<Vec<u8>, ApiError> {
        match (&self.key, &self.key_hex) {
            (Some(text), None) => Ok(text.as_bytes().to_vec()),
            (None, Some(hex)) => key_from_hex(hex).ok_or_else(|| {
                bad_request(format!(
                    "key_hex {} is not valid hex",
                    levee_hotkey::rule::quoted_key(hex.as_bytes())
                ))
            }),
            _ => Err(bad_request("give exactly one of key or key_hex".to_owned())),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SetHotBody {
    key: Option<String>,
    key_hex: Option<String>,
    duration_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TopParameters {
    limit: Option<usize>,
}

async fn list_apps(State(admin): State<HotKeyAdmin>) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!({"apps": admin.apps().await?})))
}

async fn get_rules(
    State(admin): State<HotKeyAdmin>,
    Path(app): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let rules: Vec<RuleRecord> = admin
        .rules(&app)
        .await?
        .iter()
        .map(rule_to_record)
        .collect();
    Ok(Json(json!({"app": app, "rules": rules})))
}

async fn put_rules(
    State(admin): State<HotKeyAdmin>,
    Path(app): Path<String>,
    Json(records): Json<Vec<RuleRecord>>,
) -> Result<Json<Value>, ApiError> {
    let rules = records
        .iter()
        .map(rule_from_record)
        .collect::<Result<Vec<_>, _>>()
        .map_err(bad_request)?;
    admin.set_rules(&app, &rules).await?;
    get_rules(State(admin), Path(app)).await
}

async fn list_hot(State(admin): State<HotKeyAdmin>, Path(app): Path<String>) -> Json<Value> {
    let hot: Vec<Value> = admin.hub().snapshot(&app).iter().map(event_json).collect();
    Json(json!({"app": app, "hot": hot}))
}

async fn set_hot(
    State(admin): State<HotKeyAdmin>,
    Path(app): Path<String>,
    Json(body): Json<SetHotBody>,
) -> Result<Json<Value>, ApiError> {
    let key = KeyParameter {
        key: body.key,
        key_hex: body.key_hex,
    }
    .bytes()?;
    admin.set_manual_hot(&app, &key, body.duration_ms).await?;
    Ok(Json(json!({"app": app, "hot": true})))
}

async fn remove_hot(
    State(admin): State<HotKeyAdmin>,
    Path(app): Path<String>,
    Query(parameter): Query<KeyParameter>,
) -> Result<Json<Value>, ApiError> {
    let key = parameter.bytes()?;
    Ok(Json(
        json!({"app": app, "was_hot": admin.remove_hot(&app, &key).await?}),
    ))
}

async fn top_keys(
    State(admin): State<HotKeyAdmin>,
    Path(app): Path<String>,
    Query(parameters): Query<TopParameters>,
) -> Result<Json<Value>, ApiError> {
    let keys = admin.hub().top_keys(&app, parameters.limit.unwrap_or(10))?;
    let keys: Vec<Value> = keys
        .iter()
        .map(|entry| {
            let (name, key) = key_json(&entry.key);
            let mut value = json!({"count": entry.count});
            value[name] = key;
            value
        })
        .collect();
    Ok(Json(json!({"app": app, "keys": keys})))
}

async fn stats(
    State(admin): State<HotKeyAdmin>,
    Path(app): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let (stats, clients) = admin.hub().stats(&app)?;
    Ok(Json(json!({
        "app": app,
        "hits_received": stats.hits_received,
        "reports_received": stats.reports_received,
        "hot_detected": stats.hot_detected,
        "hot_now": stats.hot_now,
        "keys_tracked": stats.keys_tracked,
        "clients_connected": clients,
    })))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Hot-key admin bodies of arbitrary bytes: a key or INVALID_ARGUMENT whose message
        /// stays short, never a panic.
        #[test]
        fn given_hostile_key_bodies_then_they_decode_or_are_refused_briefly(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            hex in "[0-9a-fA-Fz]{0,400}",
        ) {
            if let Ok(body) = serde_json::from_slice::<SetHotBody>(&bytes) {
                let _ = KeyParameter { key: body.key, key_hex: body.key_hex }.bytes();
            }
            let parameter = KeyParameter { key: None, key_hex: Some(hex.clone()) };
            match parameter.bytes() {
                Ok(key) => prop_assert_eq!(key.len() * 2, hex.len()),
                Err(error) => prop_assert!(error.0.message.len() < 200, "{}", error.0.message),
            }
        }
    }
}
