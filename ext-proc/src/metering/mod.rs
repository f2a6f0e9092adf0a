//! The metering stage: each admitted request's usage, recorded exactly once.
//!
//! A request's path through it: Envoy's gRPC access log ([`access_log`]) or the ext_proc
//! metering stream (`crate::grpc::ext_proc`) gives the filter's measured usage ([`meter`]); the
//! recorder's buffer ([`recorder`]) writes it to the ledger in Redis, idempotent by request
//! ([`ledger`]), and settles the request's reservation; the usage journal ([`journal`]) replays
//! what a crashed sidecar never received (skipping what this replica saw land: [`landed`]); the sweeper ([`sweeper`]) charges the reservations
//! whose usage never arrived and reclaims orphaned admission leases; [`usage_report`] reads the
//! daily totals back (`gatewayctl usage`).

pub mod access_log;
pub mod finish;
pub mod journal;
pub mod landed;
pub mod ledger;
pub mod meter;
pub mod recorder;
pub mod sweeper;
pub mod usage_report;
