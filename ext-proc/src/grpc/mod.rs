//! The adapters of Envoy's gRPC services: the ext_proc admission and metering streams
//! ([`ext_proc`]) and the protocol's shapes ([`protocol`]).

pub mod ext_proc;
pub mod protocol;
