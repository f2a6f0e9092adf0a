//! The batched engine (`--engine batched`): a step-by-step model of vLLM V1's scheduler with a
//! paged KV cache and automatic prefix caching, for what an endpoint picker exploits (queue
//! depth, KV-cache use, prefix affinity, a slow replica).
//!
//! [`Engine`] is pure: a state advanced by [`Engine::schedule`] (plan the next step) and
//! [`Engine::finish_step`] (the step's tokens are done), with no clock and no tokio inside, so
//! every rule is unit-tested on the host. [`EngineHandle`] is the thin tokio driver: one task per
//! server runs the steps, sleeping each step's modelled time, and hands every request its
//! generated-token count through a channel ([`Generation`]).
//!
//! # The model (vLLM V1's, with the simplifications named)
//!
//! * **Steps.** Each step first schedules the running requests in admission order (a decoding
//!   request computes one token; a request still prefilling computes its next chunk), then admits
//!   waiting requests in FIFO order while fewer than `--max-num-seqs` run, the step's token
//!   budget `--max-num-batched-tokens` is not spent and the KV cache can hold the request (below).
//!   A prompt longer than the budget left is prefilled in chunks over several steps (vLLM's
//!   chunked prefill). A request is one sequence; `n` choices cost `n` decoding sequences.
//! * **Step time** = (`--step-base-ms` + uncached prompt tokens computed in the step x
//!   `--prefill-us-per-token` + decoding sequences x `--decode-us-per-seq`) x `--slowdown`
//!   ([`EngineConfig::step_time`]). The step's tokens are delivered when it ends: a request's
//!   first token when the step that computes the last prompt token ends, then one per step.
//! * **KV cache.** `--num-gpu-blocks` blocks of `--block-size` tokens. A request's blocks are
//!   filled as its tokens are computed, so `vllm:kv_cache_usage_perc` (blocks held by running
//!   requests / all blocks; cached blocks of finished requests are free, as in vLLM) grows as
//!   it decodes. Simplification: vLLM admits a request when its next chunk fits and later
//!   preempts (recomputes) the newest request when a decode step finds no free block; the sim
//!   instead reserves at admission every block the request will need at its end
//!   (`ceil((prompt + completion tokens) / block_size)`, less its prefix hits), so it never
//!   preempts: a request whose blocks cannot be reserved waits, and so does everything behind it
//!   (FIFO). The config check makes the cache hold one `--max-model-len` request, so the head of
//!   the queue always runs once the cache drains.
//! * **Prefix caching** (vLLM's automatic prefix caching). The prompt's token stream is the sim's
//!   rendered prompt ([`crate::prompt`]), `4 x block_size` bytes per block (the sim counts 4 bytes
//!   a token); every full block gets a chained hash (of its parent's hash and its bytes). When a
//!   block's tokens have been computed it is registered under its hash. A finished or aborted
//!   request frees its blocks, last block first, to the tail of the free queue; they keep their
//!   hash until a new allocation takes them from the head (least recently freed first: LRU
//!   eviction). An admitted request's leading blocks found by hash are hits: they are shared, not
//!   computed, so only the uncached tokens cost prefill time; at least the last prompt token is
//!   always computed (as vLLM). Blocks of generated tokens are not hashed (vLLM hashes them too;
//!   the sim's rendered chat prompts would never match them). `--no-enable-prefix-caching`
//!   turns hits off and leaves the counters at 0.
//! * **Time.** The driver sleeps each step's time on tokio's timer (1 ms resolution, so a step
//!   ends up to 1 ms late); the next step is planned from the previous step's deadline, so the
//!   lateness does not add up over steps.
//! * **Counters** (vLLM V1's `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`, in
//!   tokens): at admission, queries += prompt tokens and hits += prompt tokens served from cache.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::config::SimConfig;
use crate::queue::QueueClosed;

/// A request's id inside one engine.
pub type SeqId = u64;

/// The engine's knobs, from [`SimConfig`]'s batched-engine flags (documented there).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV-cache block (`--block-size`), at least 1.
    pub block_size: u32,
    /// KV-cache blocks (`--num-gpu-blocks`), at least 1.
    pub num_gpu_blocks: u32,
    /// Requests running at once (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Tokens computed per step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Fixed cost of a step, milliseconds.
    pub step_base_ms: f64,
    /// Cost of one uncached prompt token, microseconds.
    pub prefill_us_per_token: f64,
    /// Cost of one decoding sequence in a step, microseconds.
    pub decode_us_per_seq: f64,
    /// Factor on every step time.
    pub slowdown: f64,
    /// Whether cached prompt blocks are reused (`--no-enable-prefix-caching` clears it).
    pub enable_prefix_caching: bool,
}

impl EngineConfig {
    /// The batched-engine part of `config`.
    pub fn from_sim(config: &SimConfig) -> Self {
        Self {
            block_size: config.block_size,
            num_gpu_blocks: config.num_gpu_blocks,
            max_num_seqs: config.max_num_seqs,
            max_num_batched_tokens: config.max_num_batched_tokens,
            step_base_ms: config.step_base_ms,
            prefill_us_per_token: config.prefill_us_per_token,
            decode_us_per_seq: config.decode_us_per_seq,
            slowdown: config.slowdown,
            enable_prefix_caching: config.enable_prefix_caching,
        }
    }

    /// A step's duration: `(step_base_ms x 1000 + prefill_tokens x prefill_us_per_token +
    /// decode_seqs x decode_us_per_seq) x slowdown` microseconds (saturating at
    /// [`Duration::MAX`]).
    pub fn step_time(&self, prefill_tokens: u64, decode_seqs: u64) -> Duration {
        let us = (self.step_base_ms * 1000.0
            + prefill_tokens as f64 * self.prefill_us_per_token
            + decode_seqs as f64 * self.decode_us_per_seq)
            * self.slowdown;
        Duration::try_from_secs_f64(us / 1e6).unwrap_or(Duration::MAX)
    }

    fn block_tokens(&self) -> u64 {
        u64::from(self.block_size.max(1))
    }

    /// Blocks holding `tokens` tokens.
    fn blocks_for(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_tokens())
    }
}

/// What a request asks of the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeqSpec {
    /// Prompt tokens (`usage.prompt_tokens`), at least 1.
    pub prompt_tokens: u64,
    /// Chained hashes of the prompt's full blocks, in order ([`crate::prompt::block_hashes`]);
    /// empty without prefix caching.
    pub block_hashes: Vec<u64>,
    /// Tokens to generate (per choice), at least 1.
    pub output_tokens: u64,
    /// Choices (`n`): decoding sequences this request costs per step.
    pub choices: u64,
}

/// One step as planned by [`Engine::schedule`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepPlan {
    /// Uncached prompt tokens computed in the step.
    pub prefill_tokens: u64,
    /// Decoding sequences in the step.
    pub decode_seqs: u64,
    /// The step's modelled duration ([`EngineConfig::step_time`]).
    pub duration: Duration,
}

/// A request that got a token in the finished step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// The request.
    pub id: SeqId,
    /// Tokens (per choice) generated so far.
    pub generated: u64,
    /// Whether that was its last token (it has left the engine and freed its blocks).
    pub finished: bool,
}

/// Gauges and counters at one instant, for `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineSnapshot {
    /// Requests admitted and not finished (`vllm:num_requests_running`).
    pub running: u64,
    /// Requests waiting for admission (`vllm:num_requests_waiting`).
    pub waiting: u64,
    /// Blocks held by running requests / all blocks, 0..1 (`vllm:kv_cache_usage_perc`).
    pub kv_cache_usage: f64,
    /// Prompt tokens looked up in the prefix cache (`vllm:prefix_cache_queries_total`).
    pub prefix_cache_queries: u64,
    /// Prompt tokens found there (`vllm:prefix_cache_hits_total`).
    pub prefix_cache_hits: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Block {
    refs: u32,
    hash: Option<u64>,
    /// Position in the free queue while `refs == 0`.
    free_key: Option<u64>,
}

/// The KV-cache blocks: reference counts, the free queue (LRU order) and the hash index.
#[derive(Debug)]
struct BlockPool {
    blocks: Vec<Block>,
    /// Free blocks by the order they were freed; allocation takes the first (least recent).
    free: BTreeMap<u64, u32>,
    next_key: u64,
    cached: HashMap<u64, u32>,
}

impl BlockPool {
    fn new(n: u32) -> Self {
        let mut pool = Self {
            blocks: vec![Block::default(); n as usize],
            free: BTreeMap::new(),
            next_key: 0,
            cached: HashMap::new(),
        };
        for b in 0..n {
            pool.push_free(b);
        }
        pool
    }

    fn push_free(&mut self, b: u32) {
        let key = self.next_key;
        self.next_key = self.next_key.saturating_add(1);
        if let Some(block) = self.blocks.get_mut(b as usize) {
            block.free_key = Some(key);
            self.free.insert(key, b);
        }
    }

    fn free_count(&self) -> u64 {
        self.free.len() as u64
    }

    fn used(&self) -> u64 {
        (self.blocks.len() as u64).saturating_sub(self.free_count())
    }

    fn is_free(&self, b: u32) -> bool {
        self.blocks.get(b as usize).is_some_and(|block| block.refs == 0)
    }

    /// The block cached under `hash`, if any.
    fn lookup(&self, hash: u64) -> Option<u32> {
        self.cached.get(&hash).copied()
    }

    /// Takes one more reference on a (cached) block, out of the free queue if it was free.
    fn touch(&mut self, b: u32) {
        if let Some(block) = self.blocks.get_mut(b as usize) {
            if let Some(key) = block.free_key.take() {
                self.free.remove(&key);
            }
            block.refs = block.refs.saturating_add(1);
        }
    }

    /// The least recently freed block, its cached hash evicted.
    fn allocate(&mut self) -> Option<u32> {
        let (_, b) = self.free.pop_first()?;
        let block = self.blocks.get_mut(b as usize)?;
        if let Some(hash) = block.hash.take() {
            if self.cached.get(&hash) == Some(&b) {
                self.cached.remove(&hash);
            }
        }
        *block = Block { refs: 1, hash: None, free_key: None };
        Some(b)
    }

    /// Drops one reference; a block nobody holds goes to the tail of the free queue, keeping its
    /// hash (still a hit until evicted).
    fn release(&mut self, b: u32) {
        let now_free = match self.blocks.get_mut(b as usize) {
            Some(block) if block.refs > 0 => {
                block.refs -= 1;
                block.refs == 0
            }
            _ => false,
        };
        if now_free {
            self.push_free(b);
        }
    }

    /// Forgets every cached hash (vLLM's `BlockPool.reset_prefix_cache`): only when no block is
    /// held, so a running request's blocks are never pulled from under it. Whether it reset.
    fn reset_hashes(&mut self) -> bool {
        if self.used() != 0 {
            return false;
        }
        self.cached.clear();
        for block in &mut self.blocks {
            block.hash = None;
        }
        true
    }

    /// Registers a computed full block under `hash` (the first block with a hash keeps it).
    fn register(&mut self, b: u32, hash: u64) {
        if self.cached.contains_key(&hash) {
            return;
        }
        if let Some(block) = self.blocks.get_mut(b as usize) {
            block.hash = Some(hash);
            self.cached.insert(hash, b);
        }
    }
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    prompt_tokens: u64,
    hashes: Vec<u64>,
    output_tokens: u64,
    choices: u64,
    generated: u64,
    /// Tokens whose KV is in the cache (hits included).
    computed: u64,
    blocks: Vec<u32>,
    /// Blocks reserved and not yet allocated.
    reserved: u64,
    /// Leading prompt blocks already registered (or found) in the hash index.
    registered: usize,
}

impl Seq {
    fn tokens(&self) -> u64 {
        self.prompt_tokens.saturating_add(self.generated)
    }
}

/// The engine state; see the module docs for the rules.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    pool: BlockPool,
    /// Sum of the running requests' reservations; never above the free blocks.
    reserved: u64,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    /// The planned step: (request, tokens it computes).
    step: Option<Vec<(SeqId, u64)>>,
    next_id: SeqId,
    prefix_queries: u64,
    prefix_hits: u64,
    closed: bool,
}

impl Engine {
    /// An idle engine with every block free.
    pub fn new(config: EngineConfig) -> Self {
        Self {
            pool: BlockPool::new(config.num_gpu_blocks),
            config,
            reserved: 0,
            waiting: VecDeque::new(),
            running: Vec::new(),
            step: None,
            next_id: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            closed: false,
        }
    }

    /// Queues a request (FIFO); it is admitted by a later [`Engine::schedule`].
    pub fn add(&mut self, spec: SeqSpec) -> SeqId {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        self.waiting.push_back(Seq {
            id,
            prompt_tokens: spec.prompt_tokens.max(1),
            hashes: if self.config.enable_prefix_caching { spec.block_hashes } else { Vec::new() },
            output_tokens: spec.output_tokens.max(1),
            choices: spec.choices.max(1),
            generated: 0,
            computed: 0,
            blocks: Vec::new(),
            reserved: 0,
            registered: 0,
        });
        id
    }

    /// Removes a request (client gone): a waiting one leaves the queue, a running one frees its
    /// blocks (those it filled stay cached). Whether it was there.
    pub fn abort(&mut self, id: SeqId) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.release(seq);
            return true;
        }
        false
    }

    /// Refuses further requests and drops the waiting ones (their ids); running ones go on.
    pub fn close(&mut self) -> Vec<SeqId> {
        self.closed = true;
        self.waiting.drain(..).map(|s| s.id).collect()
    }

    /// Empties the prefix cache, as vLLM's `POST /reset_prefix_cache` (a dev-mode endpoint,
    /// `VLLM_SERVER_DEV_MODE=1`) does between benchmark runs: every cached block forgets its
    /// hash, so the next prompts all miss. Refused (`false`, nothing changed) while a request runs
    /// and holds blocks, as vLLM refuses while blocks are not freed; the counters are kept (vLLM's
    /// `vllm:prefix_cache_*_total` are counters too).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.running.is_empty() && self.pool.reset_hashes()
    }

    /// Whether [`Engine::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The current gauges and counters.
    pub fn snapshot(&self) -> EngineSnapshot {
        let total = f64::from(self.config.num_gpu_blocks.max(1));
        EngineSnapshot {
            running: self.running.len() as u64,
            waiting: self.waiting.len() as u64,
            kv_cache_usage: self.pool.used() as f64 / total,
            prefix_cache_queries: self.prefix_queries,
            prefix_cache_hits: self.prefix_hits,
        }
    }

    /// Plans the next step (running requests first, then FIFO admissions); `None` when there is
    /// nothing to compute (or a step is already planned and not finished).
    pub fn schedule(&mut self) -> Option<StepPlan> {
        if self.step.is_some() {
            return None;
        }
        let mut budget = u64::from(self.config.max_num_batched_tokens);
        let mut scheduled = Vec::new();
        let (mut prefill, mut decode) = (0u64, 0u64);
        for i in 0..self.running.len() {
            if budget == 0 {
                break;
            }
            let Some(seq) = self.running.get_mut(i) else { break };
            let remaining = seq.tokens().saturating_sub(seq.computed);
            let n = remaining.min(budget);
            if n == 0 {
                continue;
            }
            if seq.generated > 0 && remaining == 1 {
                decode = decode.saturating_add(seq.choices);
            } else {
                prefill = prefill.saturating_add(n);
            }
            let upto = seq.computed.saturating_add(n);
            Self::grow(&self.config, &mut self.pool, &mut self.reserved, seq, upto);
            budget -= n;
            scheduled.push((seq.id, n));
        }
        while budget > 0 && (self.running.len() as u64) < u64::from(self.config.max_num_seqs) {
            let Some(mut seq) = self.admit() else { break };
            let n = seq.tokens().saturating_sub(seq.computed).min(budget);
            let upto = seq.computed.saturating_add(n);
            Self::grow(&self.config, &mut self.pool, &mut self.reserved, &mut seq, upto);
            budget -= n;
            prefill = prefill.saturating_add(n);
            scheduled.push((seq.id, n));
            self.running.push(seq);
        }
        if scheduled.is_empty() {
            return None;
        }
        self.step = Some(scheduled);
        Some(StepPlan {
            prefill_tokens: prefill,
            decode_seqs: decode,
            duration: self.config.step_time(prefill, decode),
        })
    }

    /// Ends the planned step: computed tokens advance, full prompt blocks are registered in the
    /// prefix cache, requests whose last token was computed get a token, finished ones leave.
    pub fn finish_step(&mut self) -> Vec<Progress> {
        let Some(scheduled) = self.step.take() else { return Vec::new() };
        let block = self.config.block_tokens();
        let mut events = Vec::new();
        for (id, n) in scheduled {
            // Aborted during the step: its work is lost.
            let Some(seq) = self.running.iter_mut().find(|s| s.id == id) else { continue };
            seq.computed = seq.computed.saturating_add(n);
            while let (Some(&hash), Some(&b)) =
                (seq.hashes.get(seq.registered), seq.blocks.get(seq.registered))
            {
                if (seq.registered as u64).saturating_add(1).saturating_mul(block) > seq.computed {
                    break;
                }
                self.pool.register(b, hash);
                seq.registered += 1;
            }
            if seq.computed >= seq.tokens() {
                seq.generated = seq.generated.saturating_add(1);
                events.push(Progress {
                    id,
                    generated: seq.generated,
                    finished: seq.generated >= seq.output_tokens,
                });
            }
        }
        let (done, running): (Vec<Seq>, Vec<Seq>) =
            std::mem::take(&mut self.running).into_iter().partition(|s| s.generated >= s.output_tokens);
        self.running = running;
        for seq in done {
            self.release(seq);
        }
        events
    }

    /// The waiting head, admitted with its prefix hits and reservation, if it fits.
    fn admit(&mut self) -> Option<Seq> {
        let seq = self.waiting.front()?;
        let block = self.config.block_tokens();
        // At least the last prompt token is computed.
        let max_hits = usize::try_from(seq.prompt_tokens.saturating_sub(1) / block).unwrap_or(usize::MAX);
        let hits: Vec<u32> = if self.config.enable_prefix_caching {
            seq.hashes.iter().take(max_hits).map_while(|h| self.pool.lookup(*h)).collect()
        } else {
            Vec::new()
        };
        let total = self.config.blocks_for(seq.prompt_tokens.saturating_add(seq.output_tokens));
        let need = total.saturating_sub(hits.len() as u64);
        let free_hits = hits.iter().filter(|b| self.pool.is_free(**b)).count() as u64;
        let available = self.pool.free_count().saturating_sub(free_hits).saturating_sub(self.reserved);
        if available < need {
            return None;
        }
        let mut seq = self.waiting.pop_front()?;
        for b in &hits {
            self.pool.touch(*b);
        }
        let hit_tokens = (hits.len() as u64).saturating_mul(block);
        if self.config.enable_prefix_caching {
            self.prefix_queries = self.prefix_queries.saturating_add(seq.prompt_tokens);
            self.prefix_hits = self.prefix_hits.saturating_add(hit_tokens);
        }
        seq.registered = hits.len();
        seq.blocks = hits;
        seq.computed = hit_tokens;
        seq.reserved = need;
        self.reserved = self.reserved.saturating_add(need);
        Some(seq)
    }

    /// Allocates blocks (from the request's reservation) until `tokens` tokens fit.
    fn grow(config: &EngineConfig, pool: &mut BlockPool, reserved: &mut u64, seq: &mut Seq, tokens: u64) {
        while (seq.blocks.len() as u64) < config.blocks_for(tokens) && seq.reserved > 0 {
            let Some(b) = pool.allocate() else { break };
            seq.blocks.push(b);
            seq.reserved -= 1;
            *reserved = reserved.saturating_sub(1);
        }
    }

    /// Frees a request's blocks, last first (so a prompt's tail is evicted before its head, as
    /// vLLM frees them), and its remaining reservation.
    fn release(&mut self, seq: Seq) {
        for b in seq.blocks.iter().rev() {
            self.pool.release(*b);
        }
        self.reserved = self.reserved.saturating_sub(seq.reserved);
    }
}

/// Timer lateness tolerated before the next step starts from "now" instead of the previous
/// step's deadline (so late timer wake-ups do not add up, and a stall is not replayed as a burst).
const STEP_SLACK: Duration = Duration::from_millis(2);

struct Driver {
    engine: Engine,
    subscribers: HashMap<SeqId, UnboundedSender<u64>>,
}

/// The tokio side of one server's engine: shared by the handlers and the engine task.
pub struct EngineHandle {
    driver: Mutex<Driver>,
    wake: Notify,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("snapshot", &self.snapshot()).finish()
    }
}

impl EngineHandle {
    /// An idle engine; start [`EngineHandle::run`] on a task to drive it.
    pub fn new(config: EngineConfig) -> Arc<Self> {
        Arc::new(Self {
            driver: Mutex::new(Driver { engine: Engine::new(config), subscribers: HashMap::new() }),
            wake: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Driver> {
        self.driver.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a request; its tokens arrive on the returned [`Generation`]. Fails once the
    /// server is shutting down.
    pub fn submit(self: &Arc<Self>, spec: SeqSpec) -> Result<Generation, QueueClosed> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = {
            let mut driver = self.lock();
            if driver.engine.is_closed() {
                return Err(QueueClosed);
            }
            let id = driver.engine.add(spec);
            driver.subscribers.insert(id, tx);
            id
        };
        self.wake.notify_one();
        Ok(Generation { handle: self.clone(), id, rx, available: 0 })
    }

    /// Refuses new requests and fails the waiting ones; running ones finish.
    pub fn close(&self) {
        let mut driver = self.lock();
        for id in driver.engine.close() {
            driver.subscribers.remove(&id);
        }
    }

    /// The gauges and counters now.
    pub fn snapshot(&self) -> EngineSnapshot {
        self.lock().engine.snapshot()
    }

    /// [`Engine::reset_prefix_cache`]: whether the cache was emptied.
    pub fn reset_prefix_cache(&self) -> bool {
        self.lock().engine.reset_prefix_cache()
    }

    fn abort(&self, id: SeqId) {
        let mut driver = self.lock();
        driver.subscribers.remove(&id);
        if driver.engine.abort(id) {
            drop(driver);
            self.wake.notify_one();
        }
    }

    /// Runs steps for ever: plan, sleep the step's time, deliver its tokens; idles when there
    /// is nothing to compute.
    pub async fn run(self: Arc<Self>) {
        let mut last_deadline = Instant::now();
        loop {
            let plan = self.lock().engine.schedule();
            let Some(plan) = plan else {
                self.wake.notified().await;
                continue;
            };
            let now = Instant::now();
            let start =
                if now.saturating_duration_since(last_deadline) <= STEP_SLACK { last_deadline } else { now };
            let deadline = start.checked_add(plan.duration).unwrap_or(start);
            tokio::time::sleep_until(deadline).await;
            last_deadline = deadline;
            let mut driver = self.lock();
            for progress in driver.engine.finish_step() {
                if let Some(tx) = driver.subscribers.get(&progress.id) {
                    let _ = tx.send(progress.generated);
                }
                if progress.finished {
                    driver.subscribers.remove(&progress.id);
                }
            }
        }
    }
}

/// One request's place in the engine: its generated-token count as the steps deliver it.
/// Dropping it (client gone, stream cut) aborts the request and frees its blocks.
#[derive(Debug)]
pub struct Generation {
    handle: Arc<EngineHandle>,
    id: SeqId,
    rx: UnboundedReceiver<u64>,
    available: u64,
}

impl Generation {
    /// Ready once at least `tokens` tokens (per choice) were generated, with the count; fails
    /// when the request was dropped by a shutdown before that.
    pub fn poll_tokens(&mut self, cx: &mut Context<'_>, tokens: u64) -> Poll<Result<u64, QueueClosed>> {
        while self.available < tokens {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(generated)) => self.available = self.available.max(generated),
                Poll::Ready(None) => return Poll::Ready(Err(QueueClosed)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(self.available))
    }

    /// [`Generation::poll_tokens`] as a future.
    pub async fn tokens(&mut self, tokens: u64) -> Result<u64, QueueClosed> {
        std::future::poll_fn(|cx| self.poll_tokens(cx, tokens)).await
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        self.handle.abort(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> EngineConfig {
        EngineConfig {
            block_size: 4,
            num_gpu_blocks: 100,
            max_num_seqs: 8,
            max_num_batched_tokens: 1000,
            step_base_ms: 1.0,
            prefill_us_per_token: 10.0,
            decode_us_per_seq: 100.0,
            slowdown: 1.0,
            enable_prefix_caching: true,
        }
    }

    fn spec(prompt_tokens: u64, block_hashes: &[u64], output_tokens: u64) -> SeqSpec {
        SeqSpec { prompt_tokens, block_hashes: block_hashes.to_vec(), output_tokens, choices: 1 }
    }

    /// Steps until idle; the plans.
    fn run(e: &mut Engine) -> Vec<StepPlan> {
        let mut plans = Vec::new();
        while let Some(plan) = e.schedule() {
            plans.push(plan);
            e.finish_step();
            assert!(plans.len() < 10_000, "engine does not finish");
        }
        plans
    }

    #[test]
    fn step_time_is_base_plus_prefill_plus_decode_times_slowdown() {
        let c = config();
        // 1 ms + 100 x 10 us + 3 x 100 us.
        assert_eq!(c.step_time(100, 3), Duration::from_micros(2300));
        assert_eq!(c.step_time(0, 0), Duration::from_millis(1));
        let slow = EngineConfig { slowdown: 3.0, ..c };
        assert_eq!(slow.step_time(100, 3), Duration::from_micros(6900));
        let huge = EngineConfig { step_base_ms: f64::MAX, ..c };
        assert_eq!(huge.step_time(0, 0), Duration::MAX);
    }

    #[test]
    fn slowdown_scales_every_step() {
        let mut fast = Engine::new(config());
        let mut slow = Engine::new(EngineConfig { slowdown: 3.0, ..config() });
        for e in [&mut fast, &mut slow] {
            e.add(spec(40, &[], 5));
            e.add(spec(7, &[], 3));
        }
        let (fast, slow) = (run(&mut fast), run(&mut slow));
        assert_eq!(fast.len(), slow.len());
        for (f, s) in fast.iter().zip(&slow) {
            assert_eq!((f.prefill_tokens, f.decode_seqs), (s.prefill_tokens, s.decode_seqs));
            assert_eq!(s.duration, f.duration * 3);
        }
    }

    #[test]
    fn a_request_prefills_then_decodes_one_token_per_step() {
        let mut e = Engine::new(config());
        let id = e.add(spec(10, &[], 3));
        let plan = e.schedule().unwrap();
        assert_eq!((plan.prefill_tokens, plan.decode_seqs), (10, 0));
        assert_eq!(plan.duration, config().step_time(10, 0));
        assert_eq!(e.schedule(), None, "one step at a time");
        assert_eq!(e.finish_step(), [Progress { id, generated: 1, finished: false }]);
        let plan = e.schedule().unwrap();
        assert_eq!((plan.prefill_tokens, plan.decode_seqs), (0, 1));
        assert_eq!(e.finish_step(), [Progress { id, generated: 2, finished: false }]);
        e.schedule().unwrap();
        assert_eq!(e.finish_step(), [Progress { id, generated: 3, finished: true }]);
        assert_eq!(e.schedule(), None);
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting, s.kv_cache_usage), (0, 0, 0.0));
    }

    #[test]
    fn n_choices_cost_n_decoding_sequences() {
        let mut e = Engine::new(config());
        e.add(SeqSpec { choices: 3, ..spec(10, &[], 2) });
        let plans = run(&mut e);
        assert_eq!(plans.iter().map(|p| p.decode_seqs).collect::<Vec<_>>(), [0, 3]);
    }

    #[test]
    fn long_prompts_are_prefilled_in_chunks_within_the_token_budget() {
        let mut e = Engine::new(EngineConfig { max_num_batched_tokens: 8, ..config() });
        let a = e.add(spec(3, &[], 4));
        let b = e.add(spec(20, &[], 1));
        // Step 1: a's 3 tokens and 5 of b's; then a decodes (1) and b gets 7; then 1 + 7, then 1 + 1.
        let mut prefill = Vec::new();
        let mut first_token_step = None;
        for step in 0.. {
            let Some(plan) = e.schedule() else { break };
            prefill.push((plan.prefill_tokens, plan.decode_seqs));
            if e.finish_step().iter().any(|p| p.id == b) {
                first_token_step = Some(step);
            }
        }
        assert_eq!(prefill, [(8, 0), (7, 1), (7, 1), (1, 1)]);
        assert_eq!(first_token_step, Some(3), "b's first token after its last chunk");
        let _ = a;
    }

    #[test]
    fn prefix_hits_skip_prefill_and_are_counted_in_tokens() {
        let mut e = Engine::new(config());
        // 13 tokens: 3 full blocks of 4.
        e.add(spec(13, &[1, 2, 3], 2));
        assert_eq!(run(&mut e)[0].prefill_tokens, 13);
        let s = e.snapshot();
        assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (13, 0));

        // The same prompt: its 3 blocks are hits, only the 13th token is computed.
        e.add(spec(13, &[1, 2, 3], 2));
        let plan = e.schedule().unwrap();
        assert_eq!(plan.prefill_tokens, 1);
        assert_eq!(plan.duration, config().step_time(1, 0));
        e.finish_step();
        run(&mut e);
        let s = e.snapshot();
        assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (26, 12));

        // A shared first block only: the chain stops at the first miss.
        e.add(spec(13, &[1, 9, 3], 2));
        assert_eq!(run(&mut e)[0].prefill_tokens, 9);
        // A prompt of exactly 3 blocks computes its last token: 2 blocks hit, 4 tokens computed.
        e.add(spec(12, &[1, 2, 3], 2));
        assert_eq!(run(&mut e)[0].prefill_tokens, 4);
        let s = e.snapshot();
        assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (26 + 13 + 12, 12 + 4 + 8));
    }

    #[test]
    fn reset_prefix_cache_makes_the_next_prompt_miss_and_waits_for_running_requests() {
        let mut e = Engine::new(config());
        e.add(spec(13, &[1, 2, 3], 2));
        run(&mut e);
        // A running request holds blocks: refused, and its prompt still hits afterwards.
        e.add(spec(13, &[1, 2, 3], 2));
        let plan = e.schedule().unwrap();
        assert_eq!(plan.prefill_tokens, 1);
        assert!(!e.reset_prefix_cache());
        e.finish_step();
        run(&mut e);
        e.add(spec(13, &[1, 2, 3], 2));
        assert_eq!(run(&mut e)[0].prefill_tokens, 1, "the refused reset kept the cache");
        // Idle: emptied, the same prompt is computed in full, the counters go on.
        assert!(e.reset_prefix_cache());
        e.add(spec(13, &[1, 2, 3], 2));
        assert_eq!(run(&mut e)[0].prefill_tokens, 13);
        let s = e.snapshot();
        assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (4 * 13, 12 + 12));
        assert_eq!(s.kv_cache_usage, 0.0);
    }

    #[test]
    fn concurrent_requests_share_hit_blocks() {
        let mut e = Engine::new(config());
        e.add(spec(13, &[1, 2, 3], 1));
        run(&mut e);
        e.add(spec(13, &[1, 2, 3], 5));
        e.add(spec(13, &[1, 2, 3], 5));
        let plan = e.schedule().unwrap();
        assert_eq!(plan.prefill_tokens, 2);
        e.finish_step();
        // 3 shared blocks + 1 block each for the 13th token (and the next 3).
        assert_eq!(e.snapshot().kv_cache_usage, 5.0 / 100.0);
        run(&mut e);
        assert_eq!(e.snapshot().kv_cache_usage, 0.0);
    }

    #[test]
    fn no_prefix_caching_prefills_everything_and_counts_nothing() {
        let mut e = Engine::new(EngineConfig { enable_prefix_caching: false, ..config() });
        for _ in 0..2 {
            e.add(spec(13, &[1, 2, 3], 2));
            assert_eq!(run(&mut e)[0].prefill_tokens, 13);
        }
        let s = e.snapshot();
        assert_eq!((s.prefix_cache_queries, s.prefix_cache_hits), (0, 0));
    }

    #[test]
    fn cached_blocks_are_evicted_least_recently_used_first() {
        // 6 blocks of 4 tokens; each request: 9 prompt tokens (2 hashed blocks) + 1 output = 3 blocks.
        let mut e = Engine::new(EngineConfig { num_gpu_blocks: 6, ..config() });
        let prefill_of = |e: &mut Engine, hashes: &[u64]| {
            e.add(spec(9, hashes, 1));
            run(e)[0].prefill_tokens
        };
        assert_eq!(prefill_of(&mut e, &[10, 11]), 9); // A
        assert_eq!(prefill_of(&mut e, &[20, 21]), 9); // B
                                                      // A again: a hit, which makes A's blocks the most recently freed.
        assert_eq!(prefill_of(&mut e, &[10, 11]), 1);
        // C needs 3 blocks: the least recently freed ones are B's.
        assert_eq!(prefill_of(&mut e, &[30, 31]), 9);
        assert_eq!(prefill_of(&mut e, &[10, 11]), 1, "A is still cached");
        assert_eq!(prefill_of(&mut e, &[20, 21]), 9, "B was evicted");
    }

    #[test]
    fn admission_is_fifo_up_to_max_num_seqs() {
        let mut e = Engine::new(EngineConfig { max_num_seqs: 2, ..config() });
        let ids: Vec<SeqId> = (0..3).map(|_| e.add(spec(4, &[], 2))).collect();
        e.schedule().unwrap();
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting), (2, 1));
        let got: Vec<SeqId> = e.finish_step().iter().map(|p| p.id).collect();
        assert_eq!(got, ids[..2]);
        e.schedule().unwrap();
        assert!(e.finish_step().iter().all(|p| p.finished));
        // The third is admitted only once a slot freed.
        let plan = e.schedule().unwrap();
        assert_eq!(plan.prefill_tokens, 4);
        assert_eq!(e.finish_step(), [Progress { id: ids[2], generated: 1, finished: false }]);
    }

    #[test]
    fn a_request_waits_while_the_kv_cache_cannot_hold_it_and_blocks_the_queue() {
        // 4 blocks of 4 tokens. A: 8 + 4 tokens = 3 blocks; B: 4 + 4 = 2 blocks; C: 1 + 1 = 1 block.
        let mut e = Engine::new(EngineConfig { num_gpu_blocks: 4, ..config() });
        let a = e.add(spec(8, &[], 4));
        let b = e.add(spec(4, &[], 4));
        e.add(spec(1, &[], 1));
        e.schedule().unwrap();
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting), (1, 2), "B waits for blocks; C waits behind B (FIFO)");
        // A's prompt fills 2 blocks; its reserved third block is not in use yet.
        assert_eq!(s.kv_cache_usage, 0.5);
        e.finish_step();
        e.schedule().unwrap();
        e.finish_step();
        assert_eq!(e.snapshot().kv_cache_usage, 0.75, "the 9th token took the third block");
        let mut finished_a = false;
        while !finished_a {
            e.schedule().unwrap();
            assert_eq!(e.snapshot().running, 1);
            finished_a = e.finish_step().iter().any(|p| p.id == a && p.finished);
        }
        e.schedule().unwrap();
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting), (2, 0), "B and C admitted once A freed its blocks");
        assert!(e.finish_step().iter().any(|p| p.id == b));
    }

    #[test]
    fn abort_frees_blocks_which_stay_cached() {
        let mut e = Engine::new(config());
        let id = e.add(spec(13, &[1, 2, 3], 100));
        e.schedule().unwrap();
        e.finish_step();
        assert!(e.snapshot().kv_cache_usage > 0.0);
        assert!(e.abort(id));
        assert!(!e.abort(id));
        assert_eq!(e.snapshot().kv_cache_usage, 0.0);
        assert_eq!(e.snapshot().running, 0);
        e.add(spec(13, &[1, 2, 3], 1));
        assert_eq!(run(&mut e)[0].prefill_tokens, 1, "the aborted request's blocks are hits");

        // Aborted during its step: the step's work is dropped, nothing is delivered.
        let id = e.add(spec(5, &[], 1));
        e.schedule().unwrap();
        e.abort(id);
        assert_eq!(e.finish_step(), []);
        // Waiting requests leave the queue.
        let mut e = Engine::new(EngineConfig { max_num_seqs: 1, ..config() });
        e.add(spec(5, &[], 10));
        let waiting = e.add(spec(5, &[], 10));
        e.schedule().unwrap();
        assert_eq!(e.snapshot().waiting, 1);
        assert!(e.abort(waiting));
        assert_eq!(e.snapshot().waiting, 0);
    }

    #[test]
    fn close_drops_waiting_requests_and_lets_running_ones_finish() {
        let mut e = Engine::new(EngineConfig { max_num_seqs: 1, ..config() });
        let running = e.add(spec(5, &[], 2));
        let waiting = e.add(spec(5, &[], 2));
        e.schedule().unwrap();
        assert_eq!(e.close(), [waiting]);
        assert!(e.is_closed());
        e.finish_step();
        e.schedule().unwrap();
        assert_eq!(e.finish_step(), [Progress { id: running, generated: 2, finished: true }]);
    }

    impl Engine {
        /// Checks the bookkeeping: reservations fit in the free blocks, every held block is
        /// counted once per holder, and the hash index points at blocks carrying that hash.
        fn check_invariants(&self) {
            assert!(
                self.reserved <= self.pool.free_count(),
                "{} > {}",
                self.reserved,
                self.pool.free_count()
            );
            let reserved: u64 = self.running.iter().map(|s| s.reserved).sum();
            assert_eq!(reserved, self.reserved);
            let mut refs = vec![0u32; self.pool.blocks.len()];
            for seq in &self.running {
                for b in &seq.blocks {
                    refs[*b as usize] += 1;
                }
                assert!(seq.computed <= seq.tokens());
            }
            for (i, block) in self.pool.blocks.iter().enumerate() {
                assert_eq!(block.refs, refs[i], "block {i}");
                assert_eq!(block.free_key.is_some(), block.refs == 0, "block {i}");
            }
            assert_eq!(self.pool.free.len(), refs.iter().filter(|r| **r == 0).count());
            for (hash, b) in &self.pool.cached {
                assert_eq!(self.pool.blocks[*b as usize].hash, Some(*hash));
            }
            assert!(self.running.len() <= self.config.max_num_seqs as usize);
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add { prompt: u64, shared: u64, output: u64 },
        Abort(u64),
        Step,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            (1u64..60, 0u64..4, 1u64..12).prop_map(|(prompt, shared, output)| Op::Add {
                prompt,
                shared,
                output
            }),
            (0u64..40).prop_map(Op::Abort),
            Just(Op::Step),
            Just(Op::Step),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::Off)),
            ..proptest::test_runner::Config::default()
        })]

        /// Any sequence of arrivals, aborts and steps keeps the bookkeeping exact, and once the
        /// arrivals stop every request finishes and every block is free again.
        #[test]
        fn random_workloads_keep_the_books_and_drain(
            ops in proptest::collection::vec(op(), 1..200),
            blocks in 18u32..40,
            budget in 1u32..64,
            seqs in 1u32..6,
        ) {
            let config = EngineConfig {
                num_gpu_blocks: blocks,
                max_num_batched_tokens: budget,
                max_num_seqs: seqs,
                ..config()
            };
            let mut e = Engine::new(config);
            let mut added = 0u64;
            let mut aborted = std::collections::HashSet::new();
            let mut finished = std::collections::HashSet::new();
            for op in ops {
                match op {
                    Op::Add { prompt, shared, output } => {
                        // Prompts share `shared` leading blocks (hashes 1, 2, ...), then are unique.
                        let hashes: Vec<u64> = (0..prompt / 4)
                            .map(|i| if i < shared { i + 1 } else { 1000 * (added + 1) + i })
                            .collect();
                        e.add(spec(prompt, &hashes, output));
                        added += 1;
                    }
                    Op::Abort(id) => {
                        if e.abort(id) {
                            aborted.insert(id);
                        }
                    }
                    Op::Step => {
                        if e.schedule().is_some() {
                            e.check_invariants();
                            finished.extend(e.finish_step().iter().filter(|p| p.finished).map(|p| p.id));
                        }
                    }
                }
                e.check_invariants();
            }
            for _ in 0..100_000 {
                if e.schedule().is_none() {
                    break;
                }
                finished.extend(e.finish_step().iter().filter(|p| p.finished).map(|p| p.id));
                e.check_invariants();
            }
            let s = e.snapshot();
            proptest::prop_assert_eq!((s.running, s.waiting, s.kv_cache_usage), (0, 0, 0.0));
            proptest::prop_assert_eq!(finished.len() + aborted.len(), added as usize);
            proptest::prop_assert!(s.prefix_cache_hits <= s.prefix_cache_queries);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_driver_delivers_tokens_at_step_ends() {
        // Whole milliseconds: tokio's timers have a 1 ms resolution.
        let handle = EngineHandle::new(EngineConfig { decode_us_per_seq: 1000.0, ..config() });
        let task = tokio::spawn(handle.clone().run());
        let start = Instant::now();
        let mut g = handle.submit(spec(100, &[], 3)).unwrap();
        assert_eq!(g.tokens(1).await, Ok(1));
        // Prefill step: 1 ms + 100 x 10 us.
        assert_eq!(start.elapsed(), Duration::from_millis(2));
        assert_eq!(g.tokens(3).await, Ok(3));
        // Two decode steps of 1 ms + 1 ms.
        assert_eq!(start.elapsed(), Duration::from_millis(6));
        assert_eq!(handle.snapshot().running, 0);
        drop(g);
        handle.close();
        assert_eq!(handle.submit(spec(1, &[], 1)).unwrap_err(), QueueClosed);
        task.abort();
    }
}
