//! Response bodies: whole JSON documents and paced token streams.
//!
//! A [`TokenStream`] is the life of one streamed request after its response headers went
//! out: it waits for a [`Slot`] in the queue, then hands hyper one SSE event per body frame,
//! the first token `ttft` after admission and the next ones `itl` apart (tokio timers, no
//! blocked thread). Dropping it (client gone) frees the slot and stops the token count.
//! With the batched engine ([`TokenStream::batched`]) the stream instead sends each token when the
//! engine step that generated it ends ([`Generation`]); dropping it aborts the request.

use std::fmt;
use std::future::Future as _;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::{Instant, Sleep};

use crate::config::Pacing;
use crate::engine::Generation;
use crate::metrics::RequestTracker;
use crate::queue::{Admission, QueueClosed, Slot};
use crate::sse::{self, EventBuf, EventKind, Events, SseEvent};
use crate::tokens::FinishReason;

/// One poll of a body: a frame, the end, or the error that cuts the connection.
type FramePoll = Poll<Option<Result<Frame<EventBuf>, StreamError>>>;

/// Why a stream ended early; hyper then closes the connection without the final chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// `--fail-after-chunks` cut the stream.
    #[error("injected upstream failure after {0} content chunks")]
    Injected(u64),
    /// The server shut down while the request was queued.
    #[error(transparent)]
    Closed(#[from] QueueClosed),
}

/// The body of every response.
#[derive(Debug)]
pub enum SimBody {
    /// A complete document (JSON, metrics text, or nothing), sent with `content-length`.
    Full(Option<Bytes>),
    /// A streamed completion, sent chunked.
    Stream(Box<TokenStream>),
}

impl SimBody {
    /// A body of `bytes`; an empty body when `bytes` is empty.
    pub fn full(bytes: Bytes) -> Self {
        Self::Full((!bytes.is_empty()).then_some(bytes))
    }
}

impl Body for SimBody {
    type Data = EventBuf;
    type Error = StreamError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> FramePoll {
        match self.get_mut() {
            Self::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(sse::whole(b))))),
            Self::Stream(stream) => stream.poll_event(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, Self::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full(bytes) => SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64)),
            Self::Stream(_) => SizeHint::default(),
        }
    }
}

enum Phase {
    /// Waiting for a slot.
    Queued(Admission),
    /// Generating; token offsets count from `started`.
    Running { started: Instant, _slot: Slot },
    /// Batched engine: tokens come as its steps end.
    Generating(Generation),
    /// `--fail-after-chunks` reached: yield once so hyper flushes what was sent, then fail.
    Failing { flushed: bool },
    /// All events sent, or failed.
    Ended,
}

impl fmt::Debug for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Queued(_) => f.write_str("Queued"),
            Self::Running { started, .. } => f.debug_struct("Running").field("started", started).finish(),
            Self::Generating(_) => f.write_str("Generating"),
            Self::Failing { flushed } => f.debug_struct("Failing").field("flushed", flushed).finish(),
            Self::Ended => f.write_str("Ended"),
        }
    }
}

/// A paced SSE stream for one request.
#[derive(Debug)]
pub struct TokenStream {
    phase: Phase,
    events: Events,
    /// The event whose time has not come yet.
    pending: Option<SseEvent>,
    pacing: Pacing,
    /// Reused for every wait of this stream.
    sleep: Option<Pin<Box<Sleep>>>,
    tracker: RequestTracker,
    finish_reason: FinishReason,
    fail_after_chunks: Option<u64>,
    chunks_sent: u64,
}

/// What a [`TokenStream`] needs besides its admission.
#[derive(Debug)]
pub struct StreamParts {
    /// The events to send.
    pub events: Events,
    /// Token pacing.
    pub pacing: Pacing,
    /// Metric accounting for this request.
    pub tracker: RequestTracker,
    /// `finish_reason` recorded once `[DONE]` is sent.
    pub finish_reason: FinishReason,
    /// `--fail-after-chunks`.
    pub fail_after_chunks: Option<u64>,
}

impl TokenStream {
    /// A stream that starts with a free `Ok(slot)` or waits on the `Err(admission)`.
    pub fn new(admission: Result<Slot, Admission>, parts: StreamParts) -> Self {
        let phase = match admission {
            Ok(slot) => Phase::Running { started: Instant::now(), _slot: slot },
            Err(wait) => Phase::Queued(wait),
        };
        Self::with_phase(phase, parts)
    }

    /// A stream whose tokens come from the batched engine as its steps generate them.
    pub fn batched(generation: Generation, parts: StreamParts) -> Self {
        Self::with_phase(Phase::Generating(generation), parts)
    }

    fn with_phase(phase: Phase, parts: StreamParts) -> Self {
        Self {
            phase,
            events: parts.events,
            pending: None,
            pacing: parts.pacing,
            sleep: None,
            tracker: parts.tracker,
            finish_reason: parts.finish_reason,
            fail_after_chunks: parts.fail_after_chunks,
            chunks_sent: 0,
        }
    }

    fn poll_event(&mut self, cx: &mut Context<'_>) -> FramePoll {
        loop {
            match &mut self.phase {
                Phase::Queued(admission) => match admission.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Ok(slot)) => {
                        self.phase = Phase::Running { started: Instant::now(), _slot: slot }
                    }
                    Poll::Ready(Err(closed)) => {
                        self.phase = Phase::Ended;
                        return Poll::Ready(Some(Err(closed.into())));
                    }
                },
                Phase::Running { .. } | Phase::Generating(_) => match self.poll_running(cx) {
                    Some(result) => return result,
                    None => continue,
                },
                Phase::Failing { flushed: false } => {
                    self.phase = Phase::Failing { flushed: true };
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Phase::Failing { flushed: true } => {
                    self.phase = Phase::Ended;
                    return Poll::Ready(Some(Err(StreamError::Injected(self.chunks_sent))));
                }
                Phase::Ended => return Poll::Ready(None),
            }
        }
    }

    /// The next frame while running or generating, or `None` after switching phase.
    fn poll_running(&mut self, cx: &mut Context<'_>) -> Option<FramePoll> {
        let Some(event) = self.pending.take().or_else(|| self.events.next()) else {
            self.phase = Phase::Ended;
            return None;
        };
        // The output token the event waits for (the role chunk goes with the first token; a
        // Responses prelude goes at once, its trailer after the last token).
        let due = match event.kind {
            EventKind::Role => Some(0),
            EventKind::Token { index } => {
                if self.fail_after_chunks == Some(self.chunks_sent) {
                    // Frees the slot (or aborts the engine request) now; the tracker counts the
                    // request as aborted.
                    self.phase = Phase::Failing { flushed: false };
                    return None;
                }
                Some(index)
            }
            EventKind::Usage | EventKind::Done | EventKind::Prelude | EventKind::Trailer => None,
        };
        match (&mut self.phase, due) {
            (Phase::Running { started, .. }, Some(index)) => {
                let offset = self.pacing.token_offset(index);
                let deadline = started.checked_add(offset).unwrap_or_else(far_future);
                if !offset.is_zero() && deadline > Instant::now() {
                    let sleep =
                        self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                    if sleep.deadline() != deadline {
                        sleep.as_mut().reset(deadline);
                    }
                    if sleep.as_mut().poll(cx).is_pending() {
                        self.pending = Some(event);
                        return Some(Poll::Pending);
                    }
                }
            }
            (Phase::Generating(generation), Some(index)) => {
                match generation.poll_tokens(cx, index.saturating_add(1)) {
                    Poll::Pending => {
                        self.pending = Some(event);
                        return Some(Poll::Pending);
                    }
                    Poll::Ready(Err(closed)) => {
                        self.phase = Phase::Ended;
                        return Some(Poll::Ready(Some(Err(closed.into()))));
                    }
                    Poll::Ready(Ok(_)) => {}
                }
            }
            _ => {}
        }
        match event.kind {
            EventKind::Token { .. } => {
                self.chunks_sent += 1;
                self.tracker.tokens_sent(1);
            }
            EventKind::Done => {
                self.tracker.finish(self.finish_reason);
                // Frees the slot as soon as the last event is handed over.
                self.phase = Phase::Ended;
            }
            EventKind::Role | EventKind::Usage | EventKind::Prelude | EventKind::Trailer => {}
        }
        Some(Poll::Ready(Some(Ok(Frame::data(event.buf)))))
    }
}

/// A deadline that never comes in practice (about 30 years), for overflowing offsets.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}
