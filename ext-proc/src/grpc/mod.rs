//! The adapters of Envoy's gRPC services, one module per service, each a thin tonic layer over
//! the stages: the ext_proc admission and metering streams ([`ext_proc`]) and the protocol's
//! shapes ([`protocol`]); the access log service ([`access_log`]); the filter's admission leases
//! ([`lease_service`]); the endpoint-picker role ([`epp`]); the health service and the refusal of
//! new admissions while draining ([`health`]).

pub mod access_log;
pub mod epp;
pub mod ext_proc;
pub mod health;
pub mod lease_service;
pub mod protocol;
