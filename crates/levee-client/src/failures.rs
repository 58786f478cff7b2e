//! Calls for when consumers fail: delayed publishes, a group's retry policy, its dead letters
//! (list, redrive) and offset resets (replay). See proto/levee/v1/topic.proto.

use std::time::Duration;

use levee_proto::v1::reset_group_offsets_request::To;
use levee_proto::v1::{
    DescribeRetryPolicyRequest, DescribeRetryPolicyResponse, ListDeadLettersRequest,
    ListDeadLettersResponse, PublishMessage, PublishRequest, RedriveDeadLettersRequest,
    ResetGroupOffsetsRequest, ResetGroupOffsetsResponse, SetRetryPolicyRequest,
};

use crate::client::Client;
use crate::error::ClientError;

/// Milliseconds of `duration`, saturated.
fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl Client {
    /// Publishes `(key, payload)` messages to `topic` to be delivered no earlier than `delay`
    /// from now (at most 7 days); returns each message's `(partition, deliver_at_ms)` (ms since
    /// the Unix epoch, by the server's clock) once stored durably. A delayed message gets its
    /// offset when delivered.
    pub async fn publish_delayed(
        &self,
        topic: &str,
        messages: &[(&[u8], &[u8])],
        delay: Duration,
    ) -> Result<Vec<(u32, u64)>, ClientError> {
        let request = PublishRequest {
            topic: topic.to_owned(),
            messages: messages
                .iter()
                .map(|(key, payload)| PublishMessage {
                    key: levee_proto::Bytes::copy_from_slice(key),
                    payload: levee_proto::Bytes::copy_from_slice(payload),
                    delay_ms: millis(delay),
                    ..PublishMessage::default()
                })
                .collect(),
            producer_id: String::new(),
            producer_name: self.producer_name(),
        };
        let response = self.topics_client().publish(request).await?.into_inner();
        let due = if response.deliver_at_ms.is_empty() {
            vec![0; response.partitions.len()]
        } else {
            response.deliver_at_ms
        };
        Ok(response.partitions.into_iter().zip(due).collect())
    }

    /// Sets `group`'s retry policy: the delays before the 2nd, 3rd, ... attempt (the last one
    /// repeats) and the deliveries a message gets before it is dead-lettered.
    pub async fn set_retry_policy(
        &self,
        group: &str,
        delays: &[Duration],
        max_attempts: u32,
    ) -> Result<(), ClientError> {
        let request = SetRetryPolicyRequest {
            group: group.to_owned(),
            delays_ms: delays.iter().copied().map(millis).collect(),
            max_attempts,
            reset_to_default: false,
        };
        self.topics_client().set_retry_policy(request).await?;
        Ok(())
    }

    /// Gives `group` the default retry policy again.
    pub async fn clear_retry_policy(&self, group: &str) -> Result<(), ClientError> {
        let request = SetRetryPolicyRequest {
            group: group.to_owned(),
            reset_to_default: true,
            ..SetRetryPolicyRequest::default()
        };
        self.topics_client().set_retry_policy(request).await?;
        Ok(())
    }

    /// `group`'s retry policy.
    pub async fn retry_policy(
        &self,
        group: &str,
    ) -> Result<DescribeRetryPolicyResponse, ClientError> {
        let request = DescribeRetryPolicyRequest {
            group: group.to_owned(),
        };
        Ok(self
            .topics_client()
            .describe_retry_policy(request)
            .await?
            .into_inner())
    }

    /// Up to `max` (1 to 1000) of `group`'s dead letters on `topic` from `from_offset`, oldest
    /// first; read on from the answer's `next_offset`.
    pub async fn dead_letters(
        &self,
        group: &str,
        topic: &str,
        from_offset: u64,
        max: u32,
    ) -> Result<ListDeadLettersResponse, ClientError> {
        let request = ListDeadLettersRequest {
            group: group.to_owned(),
            topic: topic.to_owned(),
            from_offset,
            max_messages: max,
        };
        Ok(self
            .topics_client()
            .list_dead_letters(request)
            .await?
            .into_inner())
    }

    /// Puts the dead letters at `offsets` (or, with `None`, every one) back into `group`'s
    /// retry path; returns how many.
    pub async fn redrive_dead_letters(
        &self,
        group: &str,
        topic: &str,
        offsets: Option<&[u64]>,
    ) -> Result<u64, ClientError> {
        let request = RedriveDeadLettersRequest {
            group: group.to_owned(),
            topic: topic.to_owned(),
            offsets: offsets.map(<[u64]>::to_vec).unwrap_or_default(),
            all: offsets.is_none(),
        };
        Ok(self
            .topics_client()
            .redrive_dead_letters(request)
            .await?
            .into_inner()
            .redriven)
    }

    /// Sets `group`'s committed offsets on `topic` (`partitions` empty: every one) to `to`;
    /// with `force`, members consuming are fenced and join again.
    pub async fn reset_group_offsets(
        &self,
        group: &str,
        topic: &str,
        partitions: &[u32],
        to: To,
        force: bool,
    ) -> Result<ResetGroupOffsetsResponse, ClientError> {
        let request = ResetGroupOffsetsRequest {
            group: group.to_owned(),
            topic: topic.to_owned(),
            partitions: partitions.to_vec(),
            to: Some(to),
            force,
        };
        Ok(self
            .topics_client()
            .reset_group_offsets(request)
            .await?
            .into_inner())
    }
}
