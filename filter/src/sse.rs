//! Incremental server-sent-events (SSE) processing for streamed completions whose request had
//! `stream_options.include_usage` injected by the gateway.
//!
//! With `include_usage: true`, the OpenAI API (and vLLM) sends one extra event before
//! `data: [DONE]` whose JSON has `"choices":[]` and a non-null `"usage"`, and may add
//! `"usage":null` to every other chunk. [`UsageStripper`] removes both so the client receives the
//! byte stream it would have received without the option, while everything upstream of this
//! filter (the metering sidecar) still sees the usage.
//!
//! Events are split at a blank line, with lines ended as the SSE format allows: `\n`, `\r\n` or a
//! bare `\r` (so `\n\n`, `\r\n\r\n`, `\r\r` and mixes; vLLM and OpenAI write `\n`), as the meter
//! splits them (`gateway_meter::sse`). An event split across chunks is held back until complete; an
//! incomplete event larger than the configured limit is passed through unchanged, as is the rest
//! of it up to the next boundary. Events that are not exactly one `data:` line holding a JSON
//! object are passed through unchanged.

use gateway_meter::{ChunkUsage, Meter, Usage};

use crate::json_scan::visit_object;

/// Default bound on a held-back partial event: 1 MiB.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// What to do with one response body chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkOutput {
    /// Forward the chunk as received (no copy back into Envoy).
    Unchanged,
    /// Replace the chunk with these bytes (possibly empty).
    Replace(Vec<u8>),
}

/// Where the stripper is in the lines of the current event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Boundary {
    /// In a line.
    Normal,
    /// After a line end: the next line starts (a line end now is a blank line).
    LineStart,
    /// After a `\r` that ended a line: a `\n` now is part of that line end.
    LineStartCr,
    /// After a `\r` that ended a blank line: the event ended, with the `\n` if one follows.
    BlankCr,
}

/// What one byte does to the current event ([`Boundary::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Nothing: the event goes on.
    On,
    /// The event ends with this byte.
    EndsWith,
    /// The event ended before this byte (after a blank line's `\r`), which begins the next one.
    EndedBefore,
}

impl Boundary {
    /// Feeds one byte.
    fn step(&mut self, b: u8) -> Step {
        let (next, step) = match (*self, b) {
            (Boundary::BlankCr, b'\n') | (Boundary::LineStart, b'\n') => (Boundary::Normal, Step::EndsWith),
            (Boundary::BlankCr, _) => (Boundary::Normal, Step::EndedBefore),
            (Boundary::LineStart | Boundary::LineStartCr, b'\r') => (Boundary::BlankCr, Step::On),
            (Boundary::LineStartCr, b'\n') | (Boundary::Normal, b'\n') => (Boundary::LineStart, Step::On),
            (Boundary::Normal, b'\r') => (Boundary::LineStartCr, Step::On),
            _ => (Boundary::Normal, Step::On),
        };
        *self = next;
        step
    }
}

/// Removes the injected usage event and `"usage":null` members from an SSE byte stream, chunk
/// by chunk, with bounded memory.
#[derive(Debug, Clone)]
pub struct UsageStripper {
    pending: Vec<u8>,
    boundary: Boundary,
    passthrough: bool,
    max_event_bytes: usize,
}

/// One response chunk through the meter and, when the response is stripped, the stripper, in one
/// pass (what both adapters, `filter/src/wasm.rs` and `filter-native/`, do with a chunk): the
/// chunk's output (always [`ChunkOutput::Unchanged`] without a stripper) and the usage the meter
/// finished with, at `end_of_stream` (to publish once). `now` is the clock for the meter (its
/// `needs_clock`), microseconds since the Unix epoch.
pub fn meter_chunk(
    meter: &mut Meter,
    stripper: Option<&mut UsageStripper>,
    chunk: &[u8],
    end_of_stream: bool,
    now: Option<u64>,
) -> (ChunkOutput, Option<Usage>) {
    let Some(stripper) = stripper else {
        return (ChunkOutput::Unchanged, meter.on_response_body(chunk, end_of_stream, now));
    };
    let metered = meter.is_active();
    // One pass: the stripper hands the meter each whole event it releases and strips the event
    // from the meter's reading of it (`UsageStripper::push_read`).
    let output = stripper.push_read(chunk, end_of_stream, |bytes| {
        if !metered {
            return None;
        }
        // Not the last bytes: no usage comes back before `end_of_stream`, below.
        let _ = meter.on_response_body(bytes, false, now);
        meter.take_event_usage()
    });
    let usage = if metered && end_of_stream { meter.on_response_body(&[], true, now) } else { None };
    (output, usage)
}

impl Default for UsageStripper {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl UsageStripper {
    /// A stripper that holds back at most `max_event_bytes` of an incomplete event.
    pub fn new(max_event_bytes: usize) -> Self {
        UsageStripper { pending: Vec::new(), boundary: Boundary::Normal, passthrough: false, max_event_bytes }
    }

    /// Bytes currently held back.
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Processes one chunk. At `end_of_stream`, anything held back is released unchanged.
    pub fn push(&mut self, chunk: &[u8], end_of_stream: bool) -> ChunkOutput {
        self.push_read(chunk, end_of_stream, |_| None)
    }

    /// [`UsageStripper::push`] in one pass with the meter: every byte the stripper releases goes
    /// to `read` once, in stream order (a complete event whole, and what passes through unchanged:
    /// an oversized event, and at `end_of_stream` what was held back). For a complete event,
    /// `read` may answer with its data's length and its usage member as the meter's content walk
    /// found it ([`gateway_meter::Meter::take_event_usage`], after feeding it the event): an event
    /// that is one `data:` line whose value has that length is then stripped from that answer,
    /// without walking it again. The output is the same as [`UsageStripper::push`]'s.
    pub fn push_read(
        &mut self,
        chunk: &[u8],
        end_of_stream: bool,
        mut read: impl FnMut(&[u8]) -> Option<(usize, ChunkUsage)>,
    ) -> ChunkOutput {
        let mut out = Vec::with_capacity(chunk.len() + self.pending.len());
        let mut start = 0usize;
        let mut i = 0usize;
        while i < chunk.len() {
            if self.boundary == Boundary::Normal {
                // Only a line end leaves the normal state: jump to the next one.
                match memchr::memchr2(b'\n', b'\r', chunk.get(i..).unwrap_or_default()) {
                    Some(offset) => i += offset,
                    None => break,
                }
            }
            let step = chunk.get(i).map_or(Step::On, |b| self.boundary.step(*b));
            let end = match step {
                Step::On => {
                    i += 1;
                    continue;
                }
                Step::EndsWith => i + 1,
                // The byte at `i` begins the next event: read again, in the normal state.
                Step::EndedBefore => i,
            };
            i = end;
            let part = chunk.get(start..end).unwrap_or_default();
            start = end;
            if self.passthrough {
                read(part);
                out.extend_from_slice(part);
                self.passthrough = false;
            } else if self.pending.is_empty() {
                let usage = read(part);
                emit_event(part, usage, &mut out);
            } else {
                let mut event = std::mem::take(&mut self.pending);
                event.extend_from_slice(part);
                let usage = read(&event);
                emit_event(&event, usage, &mut out);
                // The buffer is kept for the next partial event.
                event.clear();
                self.pending = event;
            }
        }
        let rest = chunk.get(start..).unwrap_or_default();
        if end_of_stream && self.boundary == Boundary::BlankCr && !self.passthrough {
            // The stream ends right after a blank line's `\r`: its event is complete.
            self.boundary = Boundary::Normal;
            let mut event = std::mem::take(&mut self.pending);
            event.extend_from_slice(rest);
            let usage = read(&event);
            emit_event(&event, usage, &mut out);
        } else if self.passthrough {
            read(rest);
            out.extend_from_slice(rest);
        } else {
            self.pending.extend_from_slice(rest);
            if self.pending.len() > self.max_event_bytes {
                read(&self.pending);
                out.append(&mut self.pending);
                self.passthrough = true;
            }
        }
        if end_of_stream && !self.pending.is_empty() {
            read(&self.pending);
            out.append(&mut self.pending);
        }
        if out == chunk {
            ChunkOutput::Unchanged
        } else {
            ChunkOutput::Replace(out)
        }
    }
}

/// Appends the transformed `event` (one complete event including its terminating blank line)
/// to `out`; `usage`: the meter's reading of it, as in [`UsageStripper::push_read`].
fn emit_event(event: &[u8], usage: Option<(usize, ChunkUsage)>, out: &mut Vec<u8>) {
    match transform_event(event, usage) {
        EventAction::Keep => out.extend_from_slice(event),
        EventAction::Drop { keep_prefix } => {
            out.extend_from_slice(event.get(..keep_prefix).unwrap_or_default())
        }
        EventAction::Remove { start, end } => {
            out.extend_from_slice(event.get(..start).unwrap_or_default());
            out.extend_from_slice(event.get(end..).unwrap_or_default());
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum EventAction {
    Keep,
    /// Drop the event, keeping its first `keep_prefix` bytes (leading blank lines).
    Drop {
        keep_prefix: usize,
    },
    /// Remove `event[start..end]` (a `"usage":null` member and one comma).
    Remove {
        start: usize,
        end: usize,
    },
}

fn is_newline(b: &u8) -> bool {
    matches!(b, b'\n' | b'\r')
}

/// The removal of a `"usage":null` member, as `ObjectScan::removal_range`: up to the next
/// member's key, else from the end of the previous member's value, else the member alone.
fn remove_null_usage(
    offset: usize,
    (start, end): (usize, usize),
    after: Option<usize>,
    before: Option<usize>,
) -> EventAction {
    let (s, e) = match (after, before) {
        (Some(next), _) => (start, next),
        (None, Some(prev)) => (prev, end),
        (None, None) => (start, end),
    };
    EventAction::Remove { start: offset + s, end: offset + e }
}

fn transform_event(event: &[u8], usage_read: Option<(usize, ChunkUsage)>) -> EventAction {
    let lead = event.iter().take_while(|b| is_newline(b)).count();
    let trail = event.iter().rev().take_while(|b| is_newline(b)).count();
    let Some(line) = event.get(lead..event.len().saturating_sub(trail)) else {
        return EventAction::Keep;
    };
    if line.is_empty() || memchr::memchr2(b'\n', b'\r', line).is_some() {
        return EventAction::Keep;
    }
    let Some(after) = line.strip_prefix(b"data:") else {
        return EventAction::Keep;
    };
    let (payload, offset) = match after.strip_prefix(b" ") {
        Some(p) => (p, lead + 6),
        None => (after, lead + 5),
    };
    // The meter read this event's data (the same bytes: one `data:` line of this length): its
    // usage member needs no second walk. Where it read it, serde_json reads the data as an
    // object with no usage numbers, so `visit_object` below finds the same members.
    match usage_read {
        Some((len, ChunkUsage::Absent)) if len == payload.len() => return EventAction::Keep,
        Some((len, ChunkUsage::Null { start, value_end, prev_end, next_start })) if len == payload.len() => {
            return remove_null_usage(offset, (start, value_end), next_start, prev_end);
        }
        _ => {}
    }
    // The top-level members, visited without collecting them: the last `usage` and `choices`
    // (those serde_json and Python's `json` keep), and what `ObjectScan::removal_range` needs to
    // remove that `usage` (the end of the member before it, the start of the one after it).
    let mut usage: Option<(usize, usize, usize, Option<usize>)> = None;
    let mut after_usage: Option<usize> = None;
    let mut choices: Option<(usize, usize)> = None;
    let mut prev_end: Option<usize> = None;
    let mut follows_usage = false;
    let visited = visit_object(payload, |m| {
        if std::mem::take(&mut follows_usage) {
            after_usage = Some(m.start);
        }
        match m.key.as_ref() {
            "usage" => {
                usage = Some((m.start, m.value_start, m.value_end, prev_end));
                after_usage = None;
                follows_usage = true;
            }
            "choices" => choices = Some((m.value_start, m.value_end)),
            _ => {}
        }
        prev_end = Some(m.value_end);
    });
    if visited.is_none() {
        return EventAction::Keep;
    }
    let Some((usage_start, usage_value_start, usage_end, before_usage)) = usage else {
        return EventAction::Keep;
    };
    if payload.get(usage_value_start..usage_end) == Some(b"null") {
        return remove_null_usage(offset, (usage_start, usage_end), after_usage, before_usage);
    }
    let empty_choices = choices.and_then(|(a, b)| payload.get(a..b)).is_some_and(|c| {
        let inner: Vec<u8> = c.iter().copied().filter(|b| !b.is_ascii_whitespace()).collect();
        inner == b"[]"
    });
    if empty_choices {
        EventAction::Drop { keep_prefix: lead }
    } else {
        EventAction::Keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK_A: &str = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"Qwen/Qwen2.5-0.5B-Instruct","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]"#;
    const CHUNK_B: &str = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"Qwen/Qwen2.5-0.5B-Instruct","choices":[{"index":0,"delta":{"content":"Hello \"world\" {}[]\n\n"},"logprobs":null,"finish_reason":null}]"#;
    const CHUNK_C: &str = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"Qwen/Qwen2.5-0.5B-Instruct","choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":"stop","stop_reason":null}]"#;
    const USAGE: &str = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"Qwen/Qwen2.5-0.5B-Instruct","choices":[],"usage":{"prompt_tokens":9,"total_tokens":12,"completion_tokens":3}}"#;
    const DONE: &str = "data: [DONE]";

    /// (what vLLM sends with include_usage injected, what the client would get without it)
    fn streams(sep: &str) -> (String, String) {
        let upstream = [
            format!("{CHUNK_A},\"usage\":null}}{sep}"),
            format!("{CHUNK_B},\"usage\":null}}{sep}"),
            format!("{CHUNK_C},\"usage\":null}}{sep}"),
            format!("{USAGE}{sep}"),
            format!("{DONE}{sep}"),
        ]
        .concat();
        let client = [
            format!("{CHUNK_A}}}{sep}"),
            format!("{CHUNK_B}}}{sep}"),
            format!("{CHUNK_C}}}{sep}"),
            format!("{DONE}{sep}"),
        ]
        .concat();
        (upstream, client)
    }

    fn feed(s: &mut UsageStripper, chunks: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        let n = chunks.len();
        for (i, c) in chunks.iter().enumerate() {
            match s.push(c, i + 1 == n) {
                ChunkOutput::Unchanged => out.extend_from_slice(c),
                ChunkOutput::Replace(r) => out.extend_from_slice(&r),
            }
        }
        out
    }

    #[test]
    fn whole_stream_in_one_chunk() {
        for sep in ["\n\n", "\r\n\r\n", "\r\r"] {
            let (up, client) = streams(sep);
            let out = feed(&mut UsageStripper::default(), &[up.as_bytes()]);
            assert_eq!(String::from_utf8(out).unwrap(), client);
        }
    }

    #[test]
    fn every_single_split_point() {
        // Every line end the SSE format allows, and mixes: a bare `\r` too (`\r\r`), which a
        // chunk boundary may split from a `\n` after it.
        for sep in ["\n\n", "\r\n\r\n", "\n\r\n", "\r\r", "\r\n\r", "\r\r\n", "\n\r"] {
            let (up, client) = streams(sep);
            let b = up.as_bytes();
            for cut in 0..=b.len() {
                let mut s = UsageStripper::default();
                let out = feed(&mut s, &[&b[..cut], &b[cut..]]);
                assert_eq!(String::from_utf8(out).unwrap(), client, "sep {sep:?} cut {cut}");
                assert_eq!(s.pending_len(), 0);
            }
        }
    }

    #[test]
    fn every_pair_of_split_points() {
        // Three chunks, every (i, j) split, on the usage event and its neighbours.
        let (up, client) = streams("\n\n");
        let b = up.as_bytes();
        let start = up.find(USAGE).unwrap() - 40;
        let end = (start + USAGE.len() + 80).min(b.len());
        for i in start..end {
            for j in i..end {
                let out = feed(&mut UsageStripper::default(), &[&b[..i], &b[i..j], &b[j..]]);
                assert_eq!(out, client.as_bytes(), "cuts {i} {j}");
            }
        }
    }

    #[test]
    fn byte_by_byte() {
        let (up, client) = streams("\r\n\r\n");
        let chunks: Vec<&[u8]> = up.as_bytes().chunks(1).collect();
        let out = feed(&mut UsageStripper::default(), &chunks);
        assert_eq!(out, client.as_bytes());
    }

    #[test]
    fn unchanged_chunks_are_not_copied() {
        let mut s = UsageStripper::default();
        let done = b"data: [DONE]\n\n";
        assert_eq!(s.push(done, false), ChunkOutput::Unchanged);
        let plain = format!("{CHUNK_C}}}\n\n");
        assert_eq!(s.push(plain.as_bytes(), false), ChunkOutput::Unchanged);
        assert_eq!(s.push(b": keep-alive\n\n", false), ChunkOutput::Unchanged);
        assert_eq!(s.push(b"", true), ChunkOutput::Unchanged);
        // A chunk with a null usage is rewritten.
        let nulled = format!("{CHUNK_C},\"usage\":null}}\n\n");
        assert_eq!(s.push(nulled.as_bytes(), false), ChunkOutput::Replace(plain.clone().into_bytes()));
        // The usage event alone becomes an empty chunk.
        let usage = format!("{USAGE}\n\n");
        assert_eq!(s.push(usage.as_bytes(), false), ChunkOutput::Replace(Vec::new()));
        // A partial event is held back, then released.
        assert_eq!(s.push(b"data: {\"a\":1", false), ChunkOutput::Replace(Vec::new()));
        assert_eq!(s.push(b"}\n\n", false), ChunkOutput::Replace(b"data: {\"a\":1}\n\n".to_vec()));
    }

    #[test]
    fn completions_stream() {
        let up = "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"hi\",\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n\
                  data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"total_tokens\":2,\"completion_tokens\":1}}\n\n\
                  data: [DONE]\n\n";
        let client = "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"hi\",\"logprobs\":null,\"finish_reason\":null}]}\n\n\
                      data: [DONE]\n\n";
        assert_eq!(feed(&mut UsageStripper::default(), &[up.as_bytes()]), client.as_bytes());
    }

    #[test]
    fn usage_in_the_middle_or_first_and_spaces() {
        let mut s = UsageStripper::default();
        let out = feed(
            &mut s,
            &[b"data: {\"usage\":null,\"a\":1}\n\ndata:{\"a\":1, \"usage\" : null , \"b\":2}\n\n"],
        );
        assert_eq!(out, b"data: {\"a\":1}\n\ndata:{\"a\":1, \"b\":2}\n\n");
    }

    #[test]
    fn non_usage_events_pass() {
        let input = b"event: error\ndata: {\"choices\":[],\"usage\":{}}\n\n\
                      data: {\"choices\":[{}],\"usage\":{\"prompt_tokens\":1}}\n\n\
                      data: not json\n\n\
                      data: {\"error\":{\"message\":\"x\"}}\n\n";
        let mut s = UsageStripper::default();
        assert_eq!(s.push(input, true), ChunkOutput::Unchanged);
    }

    #[test]
    fn oversized_partial_event_passes_through() {
        let mut s = UsageStripper::new(16);
        let big = format!("data: {{\"x\":\"{}\",\"usage\":null}}", "a".repeat(40));
        let (first, second) = big.as_bytes().split_at(30);
        // The first 30 bytes exceed the limit: released at once, unchanged.
        assert_eq!(s.push(first, false), ChunkOutput::Unchanged);
        assert_eq!(s.pending_len(), 0);
        // The rest of that event passes unchanged up to its end; the next event is processed.
        let mut rest = second.to_vec();
        rest.extend_from_slice(b"\n\ndata: {\"usage\":null}\n\n");
        let out = s.push(&rest, false);
        let mut expected = second.to_vec();
        expected.extend_from_slice(b"\n\ndata: {}\n\n");
        assert_eq!(out, ChunkOutput::Replace(expected));
    }

    #[test]
    fn incomplete_final_event_is_flushed() {
        let mut s = UsageStripper::default();
        assert_eq!(s.push(b"data: {\"usage\":null}", false), ChunkOutput::Replace(vec![]));
        assert_eq!(s.push(b"\n", true), ChunkOutput::Replace(b"data: {\"usage\":null}\n".to_vec()));
        assert_eq!(s.pending_len(), 0);
    }

    #[test]
    fn a_vllm_stream_is_stripped_from_the_meters_reading() {
        for sep in ["\n\n", "\r\n\r\n", "\r\r"] {
            let (upstream, client) = streams(sep);
            let mut meter = streaming_meter();
            let (mut s, mut answered) = (UsageStripper::default(), 0);
            let out = s.push_read(upstream.as_bytes(), true, |event| {
                meter.on_response_body(event, false, Some(2));
                let usage = meter.take_event_usage();
                answered += usize::from(usage.is_some());
                usage
            });
            assert_eq!(out, ChunkOutput::Replace(client.into_bytes()));
            // The three content chunks (escapes in one's content too); the usage chunk and
            // `[DONE]` the meter leaves to serde_json, and the stripper walks them itself.
            assert_eq!(answered, 3);
            assert!(meter.on_response_body(&[], true, Some(3)).is_some_and(|u| u.completion_tokens == 3));
        }
    }

    #[test]
    fn meter_chunk_strips_and_meters_in_one_pass_and_only_meters_without_a_stripper() {
        let (upstream, client) = streams("\n\n");
        let (half, rest) = upstream.as_bytes().split_at(upstream.len() / 2);
        let mut meter = streaming_meter();
        let mut stripper = UsageStripper::default();
        let mut out = Vec::new();
        for (chunk, last) in [(half, false), (rest, true)] {
            let (output, usage) = meter_chunk(&mut meter, Some(&mut stripper), chunk, last, Some(2));
            match output {
                ChunkOutput::Unchanged => out.extend_from_slice(chunk),
                ChunkOutput::Replace(r) => out.extend_from_slice(&r),
            }
            // The usage comes once, with the last chunk.
            assert_eq!(usage.as_ref().map(|u| u.completion_tokens), last.then_some(3));
        }
        assert_eq!(out, client.into_bytes());
        // Without a stripper the chunk goes on unchanged and the meter still reads it.
        let mut meter = streaming_meter();
        let (output, usage) = meter_chunk(&mut meter, None, upstream.as_bytes(), true, Some(2));
        assert_eq!(output, ChunkOutput::Unchanged);
        assert_eq!(usage.map(|u| u.completion_tokens), Some(3));
    }

    #[test]
    fn leading_blank_line_is_kept_when_dropping() {
        let mut s = UsageStripper::default();
        let out =
            feed(&mut s, &[b"data: [DONE]\n\n\ndata: {\"choices\":[ ],\"usage\":{\"total_tokens\":1}}\n\n"]);
        assert_eq!(out, b"data: [DONE]\n\n\n");
    }
}

/// A meter of a chat stream whose response headers arrived: what the wasm filter feeds the
/// stripper's events to (tests).
#[cfg(test)]
fn streaming_meter() -> gateway_meter::Meter {
    let mut meter = gateway_meter::Meter::new(gateway_meter::MAX_USAGE_BYTES);
    meter.set_stream(true);
    meter.start(1);
    meter.on_response_headers(200, "text/event-stream", false, 1);
    meter
}

/// [`transform_event`] against the reading it replaced (every member collected by
/// [`crate::json_scan::scan_object`]), on generated events and damaged ones.
#[cfg(test)]
mod reference {
    use super::{streaming_meter, transform_event, ChunkOutput, EventAction, UsageStripper};
    use crate::json_scan::scan_object;
    use proptest::prelude::*;

    fn collected(event: &[u8]) -> EventAction {
        let is_newline = |b: &u8| matches!(b, b'\n' | b'\r');
        let lead = event.iter().take_while(|b| is_newline(b)).count();
        let trail = event.iter().rev().take_while(|b| is_newline(b)).count();
        let Some(line) = event.get(lead..event.len().saturating_sub(trail)) else {
            return EventAction::Keep;
        };
        if line.is_empty() || line.iter().any(is_newline) {
            return EventAction::Keep;
        }
        let Some(after) = line.strip_prefix(b"data:") else {
            return EventAction::Keep;
        };
        let (payload, offset) = match after.strip_prefix(b" ") {
            Some(p) => (p, lead + 6),
            None => (after, lead + 5),
        };
        let Some(scan) = scan_object(payload) else {
            return EventAction::Keep;
        };
        let value = |key: &str| scan.get(key).and_then(|m| payload.get(m.value_start..m.value_end));
        let Some(usage) = value("usage") else {
            return EventAction::Keep;
        };
        if usage == b"null" {
            let Some(index) = scan.members.iter().rposition(|m| m.key == "usage") else {
                return EventAction::Keep;
            };
            return match scan.removal_range(index) {
                Some((s, e)) => EventAction::Remove { start: offset + s, end: offset + e },
                None => EventAction::Keep,
            };
        }
        let empty_choices = value("choices").is_some_and(|c| {
            let inner: Vec<u8> = c.iter().copied().filter(|b| !b.is_ascii_whitespace()).collect();
            inner == b"[]"
        });
        if empty_choices {
            EventAction::Drop { keep_prefix: lead }
        } else {
            EventAction::Keep
        }
    }

    fn member() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(r#""usage":null"#.to_string()),
            Just(r#" "usage" : null "#.to_string()),
            Just(r#""usage" : {"prompt_tokens":1}"#.to_string()),
            Just(r#""us\u0061ge":null"#.to_string()),
            Just(r#""choices":[]"#.to_string()),
            Just(r#""choices": [ ]"#.to_string()),
            Just(r#""choices":[{"delta":{"content":"a\"}"}}]"#.to_string()),
            Just(r#""id":"x""#.to_string()),
            Just(r#""n":12"#.to_string()),
        ]
    }

    fn event() -> impl Strategy<Value = Vec<u8>> {
        (prop::collection::vec(member(), 0..5), any::<bool>(), 0u8..3, any::<bool>()).prop_map(
            |(members, space, lead, crlf)| {
                let nl = if crlf { "\r\n" } else { "\n" };
                let lead = nl.repeat(usize::from(lead));
                let sp = if space { " " } else { "" };
                format!("{lead}data:{sp}{{{}}}{nl}{nl}", members.join(",")).into_bytes()
            },
        )
    }

    proptest! {
        // PROPTEST_CASES sets the cases; no failure file.
        #![proptest_config(ProptestConfig {
            failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::Off)),
            ..ProptestConfig::default()
        })]

        #[test]
        fn visited_as_collected(
            event in event(),
            damage in prop::option::of((any::<prop::sample::Index>(), 0usize..8)),
        ) {
            let mut event = event;
            if let Some((at, byte)) = damage {
                let i = at.index(event.len());
                event[i] = b"{}[],:\" "[byte];
            }
            prop_assert_eq!(transform_event(&event, None), collected(&event), "{}", String::from_utf8_lossy(&event));
        }

        /// The one pass with the meter strips a stream as the stripper alone does, at any split.
        #[test]
        fn stripped_in_one_pass_with_the_meter_as_alone(
            events in prop::collection::vec(prop_oneof![
                4 => event(),
                1 => Just(b"data: [DONE]\n\n".to_vec()),
                1 => Just(b": comment\ndata: {\"usage\":null}\n\n".to_vec()),
                1 => Just(b"data: {\"a\":1}\r\r\n\n".to_vec()),
            ], 1..8),
            damage in prop::option::of((any::<prop::sample::Index>(), 0usize..8)),
            cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..4),
            max_event_bytes in prop_oneof![Just(1usize << 20), 8usize..64],
        ) {
            let mut stream = events.concat();
            if let Some((at, byte)) = damage {
                let i = at.index(stream.len());
                stream[i] = b"{}[],:\" \n"[byte];
            }
            let mut cuts: Vec<usize> = cuts.iter().map(|c| c.index(stream.len() + 1)).collect();
            cuts.sort_unstable();
            let chunks: Vec<&[u8]> = std::iter::once(0)
                .chain(cuts.iter().copied())
                .zip(cuts.iter().copied().chain(std::iter::once(stream.len())))
                .map(|(a, b)| &stream[a..b])
                .collect();
            let (mut alone, mut metered) =
                (UsageStripper::new(max_event_bytes), UsageStripper::new(max_event_bytes));
            let mut meter = streaming_meter();
            let (mut a, mut b, mut fed) = (Vec::new(), Vec::new(), Vec::new());
            for (i, chunk) in chunks.iter().enumerate() {
                let last = i + 1 == chunks.len();
                match alone.push(chunk, last) {
                    ChunkOutput::Unchanged => a.extend_from_slice(chunk),
                    ChunkOutput::Replace(r) => a.extend_from_slice(&r),
                }
                let read = metered.push_read(chunk, last, |bytes| {
                    fed.extend_from_slice(bytes);
                    meter.on_response_body(bytes, false, Some(2));
                    meter.take_event_usage()
                });
                match read {
                    ChunkOutput::Unchanged => b.extend_from_slice(chunk),
                    ChunkOutput::Replace(r) => b.extend_from_slice(&r),
                }
            }
            prop_assert_eq!(&a, &b, "{}", String::from_utf8_lossy(&stream));
            // The meter was given every byte, once and in order.
            prop_assert_eq!(&fed, &stream);
        }
    }
}
