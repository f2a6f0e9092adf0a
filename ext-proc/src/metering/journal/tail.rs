//! Following the usage journal's file and writing what its lines ask to Redis, under the
//! journal's lease ([`crate::metering::journal`] says how).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::data::accesslog::v3::HttpAccessLogEntry;
use futures::future::join_all;
use tokio::sync::watch;
use tracing::{debug, info, warn};

use crate::admission::admission_lease::LeaseUse;
use crate::admission::limits;
use crate::config::JournalConfig;
use crate::metering::access_log::{self, Entry};
use crate::metering::journal::{keys, line_record_id, parse_line, Checkpoint};
use crate::metering::ledger;
use crate::metering::meter::UsageRecord;
use crate::state::{Live, Shared};
use crate::store::{Applied, Store, StoreError};

/// What the journal applies for one line, and how far it got (kept across retries, so that a
/// record whose script landed but whose event did not gets its event).
#[derive(Debug)]
enum Op {
    Record {
        record: Box<UsageRecord>,
        settlements: Vec<(limits::BucketSpec, i64)>,
        /// The request's part in its admission lease's books.
        lease: Option<LeaseUse>,
        /// The ledger script landed (only the event is left).
        applied: bool,
    },
    Release {
        tenant: String,
        record_id: String,
        buckets: Vec<limits::BucketSpec>,
    },
}

impl Op {
    fn record_id(&self) -> &str {
        match self {
            Op::Record { record, .. } => &record.info.record_id,
            Op::Release { record_id, .. } => record_id,
        }
    }
}

/// How a line's application ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    /// The journal applied what no other delivery had (the gRPC path lost it).
    Applied,
    /// Applied before (the gRPC path, or an earlier replay), or nothing to do.
    Nothing,
}

/// The ledger write of one entry, or `None` (not admitted, an unconfigured tenant, counts past
/// what Redis holds).
fn op_of(shared: &Shared, entry: &HttpAccessLogEntry) -> Option<Op> {
    match access_log::entry_of(entry, String::new) {
        Entry::Record(record) => {
            let mut record = *record;
            if record.info.record_id.is_empty() || !record.fits_ledger() {
                return None;
            }
            let tenant = shared.config.tenant(&record.info.tenant)?;
            if record.finished_at_unix_ms == 0 {
                record.finished_at_unix_ms = unix_ms();
            }
            let prefix = shared.limiter.store().prefix();
            let settlements = if record.info.reserved_locally {
                Vec::new()
            } else {
                let api_key = record.info.api_key.as_deref();
                let buckets = limits::token_buckets_for_key(prefix, tenant, &record.info.model, api_key);
                ledger::settlements(buckets, record.info.reserved_tokens, record.total_tokens())
            };
            let lease = LeaseUse::of_record(prefix, tenant, &record.info, &shared.reported_leases);
            Some(Op::Record { record: Box::new(record), settlements, lease, applied: false })
        }
        Entry::Release { tenant, model, record_id } => {
            let config = shared.config.tenant(&tenant)?;
            let buckets = limits::plan(shared.limiter.store().prefix(), config, &model, 0);
            Some(Op::Release { tenant: config.id.clone(), record_id, buckets })
        }
        Entry::Nothing => None,
    }
}

async fn apply(store: &Store, op: &mut Op) -> Result<Done, StoreError> {
    match op {
        Op::Release { tenant, record_id, buckets } => {
            let released = store.release(tenant, record_id, buckets).await?;
            Ok(if released { Done::Applied } else { Done::Nothing })
        }
        Op::Record { record, settlements, lease, applied } => {
            if !*applied {
                match store.apply(record, settlements, false, lease.as_ref()).await? {
                    Applied::Applied => *applied = true,
                    // Landed by this replica's earlier attempt, or by another delivery, which may
                    // have gone away before appending its event: the event is appended once per
                    // record id, so it is asked for again.
                    Applied::Duplicate => {
                        let appended = store.append(record).await?;
                        return Ok(if appended { Done::Applied } else { Done::Nothing });
                    }
                    Applied::AfterCharge => return Ok(Done::Nothing),
                }
            }
            store.append(record).await?;
            Ok(Done::Applied)
        }
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The file being read and where.
struct Reader {
    file: File,
    at: Checkpoint,
}

fn identity(meta: &std::fs::Metadata) -> (u64, u64) {
    (meta.dev(), meta.ino())
}

/// Opens the journal at `path` positioned at the checkpoint if it names that file (and the file
/// is at least that long), else at 0.
fn open_at(path: &Path, checkpoint: Option<Checkpoint>) -> std::io::Result<Reader> {
    let mut file = File::open(path)?;
    let meta = file.metadata()?;
    let (dev, ino) = identity(&meta);
    let offset = match checkpoint {
        Some(c) if (c.dev, c.ino) == (dev, ino) && c.offset <= meta.len() => c.offset,
        _ => 0,
    };
    file.seek(SeekFrom::Start(offset))?;
    Ok(Reader { file, at: Checkpoint { dev, ino, offset } })
}

/// Reads up to `most_lines` complete lines from the reader's offset (without moving it).
fn read_lines(reader: &mut Reader, most_lines: usize) -> std::io::Result<Vec<u8>> {
    reader.file.seek(SeekFrom::Start(reader.at.offset))?;
    let mut out = Vec::new();
    let mut chunk = vec![0u8; 256 * 1024];
    loop {
        let n = reader.file.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        out.extend_from_slice(chunk.get(..n).unwrap_or_default());
        if out.iter().filter(|&&b| b == b'\n').count() >= most_lines || out.len() >= 16 << 20 {
            break;
        }
    }
    // Cut at the `most_lines`-th newline, else at the last one.
    let mut seen = 0;
    let mut cut = 0;
    for (i, b) in out.iter().enumerate() {
        if *b == b'\n' {
            seen += 1;
            cut = i + 1;
            if seen == most_lines {
                break;
            }
        }
    }
    out.truncate(cut);
    Ok(out)
}

/// A random 64-bit value (the lease owner's token).
fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Tails the journal until `stop` turns true (see [`crate::metering::journal`]).
pub async fn run(live: Arc<Live>, config: JournalConfig, mut stop: watch::Receiver<bool>) {
    let store = live.current().limiter.store().clone();
    let name = config.name();
    let (lease_key, checkpoint_key) = keys(store.prefix(), &name);
    let owner = format!("{}-{:016x}", std::process::id(), rand_u64());
    let lease = Duration::from_millis(config.lease_ms);
    let mut tick = tokio::time::interval(Duration::from_millis(config.poll_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let tailer = Tailer { live, store, config, name, lease_key, checkpoint_key, owner, lease };
    let mut state = TailState::default();
    info!(path = %tailer.config.path.display(), name = %tailer.name, owner = %tailer.owner, "usage journal: tailing when this replica holds its lease");
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|stopping| *stopping) => break,
        }
        if !tailer.hold_lease(&mut state).await {
            continue;
        }
        if state.reader.is_none() {
            state.reader = tailer.open(state.committed).await;
        }
        let Some(r) = state.reader.as_mut() else { continue };
        match tailer.drain(r, &mut stop).await {
            Ok(()) => state.committed = Some(r.at),
            Err(why) => {
                // Start again from the checkpoint Redis holds (idempotent replays).
                warn!(%why, "usage journal: batch not committed; resuming from the checkpoint");
                state.reader = None;
                continue;
            }
        }
        tailer.follow_rotation(&mut state).await;
    }
    if state.holding {
        let _ = tailer.store.journal_release(&tailer.lease_key, &tailer.owner).await;
    }
}

/// One replica's tail of one journal: where it writes and under which lease.
struct Tailer {
    /// Each batch is read under the generation serving when it starts (tenants, limits).
    live: Arc<Live>,
    store: Store,
    config: JournalConfig,
    /// The journal's name (its Redis keys).
    name: String,
    lease_key: String,
    checkpoint_key: String,
    /// This replica's lease token.
    owner: String,
    lease: Duration,
}

/// What a tail holds between polls.
#[derive(Default)]
struct TailState {
    /// Whether this replica held the lease at its last renewal.
    holding: bool,
    /// The open file, at the offset read up to.
    reader: Option<Reader>,
    /// Where this replica last committed while holding the lease: a Redis that lost its data (a
    /// restart without persistence) lost the checkpoint too, and reading the journal again from
    /// 0 would apply again the records whose idempotency sets went with it.
    committed: Option<Checkpoint>,
}

impl Tailer {
    /// Takes or renews the lease; whether this replica holds it (dropping the reader when it
    /// changed hands).
    async fn hold_lease(&self, state: &mut TailState) -> bool {
        match self.store.journal_lease(&self.lease_key, &self.owner, self.lease).await {
            Ok(true) => {
                if !state.holding {
                    info!(name = %self.name, "usage journal: lease taken");
                    state.holding = true;
                    state.reader = None;
                }
                self.live.current().metrics.journal_holder.set(1);
                true
            }
            Ok(false) => {
                if state.holding {
                    warn!(name = %self.name, "usage journal: lease lost to another replica");
                }
                *state = TailState::default();
                self.live.current().metrics.journal_holder.set(0);
                false
            }
            Err(error) => {
                debug!(%error, "usage journal: lease call failed");
                false
            }
        }
    }

    /// Opens the file at the checkpoint Redis holds (or, when Redis lost it, at `committed`).
    async fn open(&self, committed: Option<Checkpoint>) -> Option<Reader> {
        let checkpoint = match self.store.journal_checkpoint(&self.checkpoint_key).await {
            Ok(None) if committed.is_some() => {
                warn!(?committed, "usage journal: Redis has no checkpoint (its data was lost?); resuming where this replica committed");
                committed
            }
            Ok(c) => c,
            Err(error) => {
                debug!(%error, "usage journal: checkpoint read failed");
                return None;
            }
        };
        match open_at(&self.config.path, checkpoint) {
            Ok(r) => {
                info!(offset = r.at.offset, ?checkpoint, "usage journal: reading");
                Some(r)
            }
            Err(error) => {
                debug!(%error, path = %self.config.path.display(), "usage journal: not readable yet");
                None
            }
        }
    }

    /// Rotation or truncation: the path names another file (the old one was read to its end,
    /// the new one is read from 0), or this one shrank (read again from 0). Else the lag.
    async fn follow_rotation(&self, state: &mut TailState) {
        let meta = match std::fs::metadata(&self.config.path) {
            Ok(meta) => meta,
            Err(error) => {
                debug!(%error, "usage journal: path not readable");
                return;
            }
        };
        let now = identity(&meta);
        let Some(r) = state.reader.as_mut() else { return };
        if now != (r.at.dev, r.at.ino) {
            info!("usage journal: the path names a new file; reading it from 0");
            self.live.current().metrics.journal_files.inc();
            state.reader = None;
            if let Ok(fresh) = open_at(&self.config.path, None) {
                let at = fresh.at;
                if matches!(self.commit(at).await, Ok(true)) {
                    state.committed = Some(at);
                    state.reader = Some(fresh);
                }
            }
        } else if meta.len() < r.at.offset {
            warn!(offset = r.at.offset, len = meta.len(), "usage journal: file truncated; reading it from 0");
            state.reader = None;
            let _ = self.commit(Checkpoint { dev: now.0, ino: now.1, offset: 0 }).await;
        } else {
            let lag = i64::try_from(meta.len() - r.at.offset).unwrap_or(i64::MAX);
            self.live.current().metrics.journal_lag_bytes.set(lag);
        }
    }

    /// Moves the checkpoint to `at`, if this replica still holds the lease (whether it moved).
    async fn commit(&self, at: Checkpoint) -> Result<bool, StoreError> {
        self.store.journal_commit(&self.lease_key, &self.checkpoint_key, &self.owner, at, self.lease).await
    }

    /// Applies the complete lines after the reader's offset, batch by batch, moving the
    /// checkpoint after each batch Redis applied.
    async fn drain(&self, reader: &mut Reader, stop: &mut watch::Receiver<bool>) -> Result<(), String> {
        loop {
            if *stop.borrow() {
                return Ok(());
            }
            let bytes = read_lines(reader, self.config.batch_lines).map_err(|e| e.to_string())?;
            if bytes.is_empty() {
                return Ok(());
            }
            let ops = self.ops_of(&bytes);
            self.apply_all(ops, stop).await?;
            let next = Checkpoint { offset: reader.at.offset + bytes.len() as u64, ..reader.at };
            match self.commit(next).await {
                Ok(true) => reader.at = next,
                Ok(false) => return Err("lease lost: checkpoint not moved".into()),
                Err(error) => return Err(format!("checkpoint not written: {error}")),
            }
        }
    }

    /// The ledger writes of a batch of complete lines, less those this replica's recorder saw
    /// land (Redis would answer "done").
    fn ops_of(&self, bytes: &[u8]) -> Vec<(Op, bool)> {
        let shared = &self.live.current();
        let mut ops = Vec::new();
        for line in bytes.split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            shared.metrics.journal_lines.inc();
            if line_record_id(line).is_some_and(|id| shared.recorder.landed(&id)) {
                shared.metrics.journal_lines_landed.inc();
                continue;
            }
            match parse_line(line) {
                Ok(Some(entry)) => match op_of(shared, &entry) {
                    Some(op) if shared.recorder.landed(op.record_id()) => {
                        shared.metrics.journal_lines_landed.inc();
                    }
                    Some(op) => ops.push((op, false)),
                    None => {}
                },
                Ok(None) => {}
                Err(why) => {
                    warn!(%why, "usage journal: unreadable line skipped");
                    shared.metrics.journal_parse_errors.inc();
                }
            }
        }
        ops
    }

    /// Applies every write, retrying the failed ones with backoff while this replica keeps the
    /// lease. An error: stopping, or the lease lost, with writes unconfirmed.
    async fn apply_all(&self, mut ops: Vec<(Op, bool)>, stop: &watch::Receiver<bool>) -> Result<(), String> {
        let mut backoff = Duration::from_millis(50);
        loop {
            let pending = ops.iter_mut().filter(|(_, done)| !*done);
            let store = &self.store;
            let results =
                join_all(pending.map(|(op, done)| async move { (done, apply(store, op).await) })).await;
            let mut failed = 0;
            for (done, result) in results {
                match result {
                    Ok(Done::Applied) => {
                        *done = true;
                        self.live.current().metrics.journal_records_applied.inc();
                    }
                    Ok(Done::Nothing) => *done = true,
                    Err(error) => {
                        failed += 1;
                        debug!(%error, "usage journal: ledger write failed; retried");
                    }
                }
            }
            if failed == 0 {
                return Ok(());
            }
            if *stop.borrow() {
                return Err("stopping with writes unconfirmed".into());
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
            // Keep the lease while Redis is away; losing it ends this batch uncommitted.
            if !self.store.journal_lease(&self.lease_key, &self.owner, self.lease).await.unwrap_or(false) {
                return Err("lease lost while retrying".into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_stops_at_the_batch_and_at_a_partial_line() {
        let dir = std::env::temp_dir().join(format!("journal-test-{}", rand_u64()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("j.log");
        std::fs::write(&path, b"a\nb\nc\npartial").unwrap();
        let mut r = open_at(&path, None).unwrap();
        assert_eq!(read_lines(&mut r, 2).unwrap(), b"a\nb\n");
        r.at.offset = 4;
        assert_eq!(read_lines(&mut r, 10).unwrap(), b"c\n");
        r.at.offset = 6;
        assert_eq!(read_lines(&mut r, 10).unwrap(), b"");
        // A checkpoint of this file resumes there; of another file, or past the end, from 0.
        let at = r.at;
        assert_eq!(open_at(&path, Some(at)).unwrap().at.offset, 6);
        assert_eq!(open_at(&path, Some(Checkpoint { ino: at.ino + 1, ..at })).unwrap().at.offset, 0);
        assert_eq!(open_at(&path, Some(Checkpoint { offset: 1000, ..at })).unwrap().at.offset, 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
