//! The endpoint picker: for each admitted request of a pool with `picker`, which of
//! the pool's vLLM endpoints serves it, from what the sidecar knows of each: its queue
//! (`vllm:num_requests_waiting`), its KV-cache use (`vllm:kv_cache_usage_perc`), the requests
//! this sidecar has in flight on it, and the prompt prefix it served recently. No I/O and no
//! clock of its own: [`crate::pools`] feeds it scrapes and the time, [`crate::admission::pipeline`] asks
//! it for picks and sends them to Envoy (header `x-gateway-destination-endpoint` and metadata
//! `envoy.lb`, the Gateway API Inference Extension's endpoint-picker protocol), and the access
//! log tells it when a request ended.
//!
//! - [`scorers`]: one small plugin per signal, each scoring the eligible endpoints in [0, 1];
//! - [`prefix_index`]: per endpoint, an LRU of the prompt-block hashes it served;
//! - [`home`]: each shared prefix's home endpoint (rendezvous hashing with bounded loads), which
//!   keeps the replicas' caches disjoint;
//! - [`picker`]: eligibility (fresh metrics, subset hint), the weighted sum, bounded-load prefix
//!   affinity, the fallbacks, and the per-pool state;
//! - [`ttft_model`]: the pool's model of a request's TTFT on an endpoint (queue ahead, uncached
//!   prompt), fitted online to the TTFTs the gateway measures: what `predicted_ttft` scoring ranks by;
//! - [`slots`]: a flow-controlled pool's engine slots per endpoint, and the slots its queue
//!   promised to the requests it dispatched (a freed slot to a request whose prefix it holds);
//! - [`prompt`]: a raw request body's prompt, hashed in blocks as the wasm filter hashes it (the
//!   endpoint-picker role, which gets the body and not the filter's facts).

pub mod home;
pub mod picker;
pub mod prefix_index;
pub mod prompt;
pub mod scorers;
pub mod slots;
pub mod ttft_model;
