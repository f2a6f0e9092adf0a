//! `vllm-sim`: a vLLM-compatible OpenAI upstream for integration tests and benchmarks.
//!
//! It answers like `vllm serve` (same routes, JSON shapes, SSE framing, error bodies and
//! metric names) without a GPU, a model or a tokenizer, and generates tokens at a
//! configured pace, so tests and benchmarks can put it where a GPU pool would be.
//!
//! # Routes
//!
//! * `POST /v1/chat/completions`, `POST /v1/completions`: streamed (`"stream": true`,
//!   `text/event-stream`) or not; see [`sse`] and [`response`].
//! * `POST /v1/responses` (OpenAI's Responses API as vLLM serves it, stateless): streamed (typed
//!   events ending in `response.completed` with the usage) or not (a `response` object); see
//!   [`responses`], which names its sources.
//! * `GET /v1/models`: the served names, OpenAI's list shape.
//! * `GET /health`: 200 with an empty body.
//! * `GET /metrics`: Prometheus text under vLLM's names; see [`metrics`].
//! * `POST /reset_prefix_cache` (vLLM's dev-mode route, served there with
//!   `VLLM_SERVER_DEV_MODE=1`): empties the batched engine's prefix cache, `{"success": true}`;
//!   `{"success": false}` and nothing changed while a request holds blocks (as vLLM); always
//!   `{"success": true}` on the plain engine, which has no cache. For benchmarks whose arms must
//!   each start cold.
//!
//! # Prompt tokens
//!
//! With no tokenizer, prompt tokens are counted by a fixed formula ([`tokens`]):
//!
//! * a text costs `tokens(text) = ceil(utf8_bytes(text) / 4)` (0 for `""`, at least 1 otherwise;
//!   bytes after JSON unescaping);
//! * chat: `sum over messages of (tokens(role) + tokens(content) + 3) + 3`, where `content` is
//!   a string, `null` (0), or an array of parts of which only `{"type":"text","text":...}`
//!   parts count (the sum of their `tokens(text)`); the last `+ 3` is the assistant
//!   generation prompt;
//! * completions: `tokens(prompt)` for a string prompt; for an array, the sum over its
//!   elements, a string costing `tokens(string)`, a token id 1 and an array of ids its length
//!   (a batch of prompts is answered as one choice).
//! * responses: the chat formula over the messages vLLM builds: a non-empty `instructions` as a
//!   `system` message, then `input`, a string as one `user` message or an array of items of which
//!   the messages (a `role`; `type` absent or `"message"`) count, their `input_text`,
//!   `output_text` and `text` parts being their text.
//!
//! # Output
//!
//! Output token `i` is the word `response::WORDS[i % 8]` plus a space ("the ", "quick ", ...), so a
//! completion of `n` tokens is `n` words and a stream has `n` content chunks. Length rules
//! (vLLM's): the effective `max_tokens` is `max_completion_tokens`, else `max_tokens`, else
//! `max_model_len - prompt_tokens`; the completion has the effective `max_tokens` tokens
//! with `ignore_eos`, else `min(effective max_tokens, --output-tokens)`; `finish_reason` is
//! `"length"` when it reached the effective `max_tokens`, else `"stop"`. A request whose
//! `prompt + max_tokens` exceeds `--max-model-len` (or whose prompt alone fills it when
//! `max_tokens` is absent) gets vLLM's 400. The Responses API's `max_output_tokens` is its
//! `max_tokens`, but capped to what the context leaves, as vLLM caps it: only a prompt that
//! fills the context is refused there.
//!
//! `n` (default 1; 0 is vLLM's 400) gives that many choices, each generated as above (the same
//! text, side by side: a non-streamed body has `choices[0..n]`, a stream one chunk per choice
//! and token position with the choice's `index`); `usage.completion_tokens` is the sum over the
//! choices and `usage.prompt_tokens` counts the prompt once, as vLLM reports them. The context
//! check stays per sequence. `best_of` is ignored.
//! A non-streamed chat request with `"logprobs": true` (and `top_logprobs` 0 to 20) gets vLLM's
//! `choices[0].logprobs.content`, one entry per output token with its `top_logprobs`
//! alternatives (deterministic values, about 60 + 50 x `top_logprobs` bytes each: the way to a
//! response body of several MiB); streamed chunks and completions carry none.
//!
//! # Pacing and queueing
//!
//! `--engine fixed` (the default): at most `--max-num-seqs` requests generate at once; the rest
//! wait in FIFO order ([`queue`]). A request's first token comes `--ttft-ms` after it leaves the
//! queue, the next ones `--itl-ms` apart, whatever else runs. Streamed responses send their
//! headers at once (as vLLM does) and wait for their slot inside the body; a non-streamed response
//! sends its headers with the whole body, after the last token (so `--ttft-ms` delays its headers).
//!
//! `--engine batched`: the tokens come from a step model of vLLM V1's scheduler ([`engine`]):
//! each step decodes one token for every running request and admits waiting ones (FIFO, up to
//! `--max-num-seqs`, within the step's `--max-num-batched-tokens` and the free KV-cache blocks),
//! prefilling long prompts in chunks; a step lasts `(--step-base-ms + uncached prompt tokens x
//! --prefill-us-per-token + decoding sequences x --decode-us-per-seq) x --slowdown`, and its tokens
//! are sent when it ends. The KV cache has `--num-gpu-blocks` blocks of `--block-size` tokens;
//! prompt blocks are hashed from the rendered prompt ([`prompt`]) and stay cached (LRU) after
//! their request ends, so a prompt sharing a prefix with an earlier one skips that part of the
//! prefill. `--ttft-ms` and `--itl-ms` are ignored. Defaults (Llama 3.1 8B in BF16 on one H100 SXM,
//! derived from published figures, see [`config`]): 16-token blocks, 24,800 blocks, 8,192
//! tokens a step, 5 ms a step, 40 us per prompt token, 40 us per decoding sequence, slowdown 1.
//! `--profile cpu-gemma-270m` sets these to vLLM 0.32's CPU build serving Gemma-3-270M on one core,
//! fitted to that engine's measured TTFTs and inter-token latencies ([`config::CPU_GEMMA_270M`]
//! says how; a flag given on the command line overrides its profile's value).
//! `/metrics` then also has `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`,
//! and `vllm:kv_cache_usage_perc` is the share of blocks held by running requests.
//!
//! # Embedding
//!
//! ```no_run
//! # async fn run() -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr()?;
//! let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
//! let server = tokio::spawn(vllm_sim::serve(
//!     vllm_sim::SimConfig { ttft_ms: 20.0, ..Default::default() },
//!     listener,
//!     async move { let _ = stopped.await; },
//! ));
//! // ... send requests to http://{addr} ...
//! # let _ = addr;
//! let _ = stop.send(());
//! server.await??;
//! # Ok(())
//! # }
//! ```

pub mod body;
pub mod config;
pub mod engine;
pub mod error;
pub mod fault;
pub mod metrics;
pub mod prompt;
pub mod queue;
pub mod request;
pub mod response;
pub mod responses;
pub mod server;
pub mod sse;
pub mod tokens;

pub use config::{Cli, EngineKind, Profile, SimConfig};
pub use server::serve;
