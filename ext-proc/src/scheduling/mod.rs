//! The endpoint picker (issue 12): for each admitted request of a pool with `picker`, which of
//! the pool's vLLM endpoints serves it, from what the sidecar knows of each: its queue
//! (`vllm:num_requests_waiting`), its KV-cache use (`vllm:kv_cache_usage_perc`), the requests
//! this sidecar has in flight on it, and the prompt prefix it served recently. No I/O and no
//! clock of its own: [`crate::pools`] feeds it scrapes and the time, [`crate::service`] asks it
//! for picks and sends them to Envoy (header `x-gateway-destination-endpoint` and metadata
//! `envoy.lb`, the Gateway API Inference Extension's endpoint-picker protocol), and the access
//! log tells it when a request ended.
//!
//! - [`scorers`]: one small plugin per signal, each scoring the eligible endpoints in [0, 1];
//! - [`prefix_index`]: per endpoint, an LRU of the prompt-block hashes it served;
//! - [`picker`]: eligibility (fresh metrics, subset hint), the weighted sum, bounded-load prefix
//!   affinity, the fallbacks, and the per-pool state.

pub mod picker;
pub mod prefix_index;
pub mod scorers;

pub use picker::{choose, Choice, EndpointState, Pick, PoolPicker};
pub use prefix_index::PrefixIndex;
pub use scorers::{Candidate, Scorer};
