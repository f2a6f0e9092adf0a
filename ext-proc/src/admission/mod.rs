//! The admission stage: whether a request goes upstream now, and what it reserves.
//!
//! A request's path through it ([`pipeline`] runs the stages in order, per ext_proc stream): the exact
//! prompt count where only it can decide the context rule ([`context`]); shedding in front of a
//! saturated pool ([`shedding`]; flow control's queue is [`crate::flow_control`]); quotas
//! ([`quota`]); the RPM/TPM plan and its take in Redis ([`limits`], [`limiter`], with the
//! in-memory buckets of [`local_limiter`], the circuit breaker of [`breaker`] and the sidecar's
//! own token leases of [`lease`]); and the filter's admission leases ([`admission_lease`], served
//! by [`crate::grpc::lease_service`], bounded by a load-protected pool's headroom: [`lease_headroom`]).
//!
//! What the limiter's outcome means for a request is [`decision`].

pub mod admission_lease;
pub mod admit;
pub mod breaker;
pub mod context;
pub mod decision;
pub mod lease;
pub mod lease_headroom;
pub mod limiter;
pub mod limits;
pub mod local_limiter;
pub mod pipeline;
pub mod quota;
pub mod shedding;
