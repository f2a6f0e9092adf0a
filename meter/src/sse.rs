//! An incremental Server-Sent Events parser, fed arbitrary chunk boundaries, bounded in memory.
//!
//! It follows the WHATWG event-stream format: lines end in `\n`, `\r\n` or a bare `\r` (OpenAI and
//! vLLM write `\n`; the format allows all three, and a bare `\r` split from its `\n` by a chunk
//! boundary is one line end); a blank line dispatches the event; `data:` lines (one optional space
//! after the colon) are joined with `\n`; lines starting with `:` are comments; other fields
//! (`event:`, `id:`, `retry:`) are ignored. A line or an event larger than the configured bound is
//! dropped whole (and counted), whatever the upstream sends, so memory never grows past it.

/// Incremental parser state. Feed chunks with [`SseParser::feed`].
#[derive(Debug)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<u8>,
    has_data: bool,
    max_event_bytes: usize,
    discarding_line: bool,
    discarding_event: bool,
    dropped_events: u64,
    /// The last chunk ended in a `\r` line end: a `\n` that begins the next one is part of it.
    skip_lf: bool,
}

impl SseParser {
    /// A parser that holds at most `max_event_bytes` of one line and of one event's data.
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            line: Vec::new(),
            data: Vec::new(),
            has_data: false,
            max_event_bytes,
            discarding_line: false,
            discarding_event: false,
            dropped_events: 0,
            skip_lf: false,
        }
    }

    /// Feeds one chunk; calls `on_event` with the data of every event the chunk completes.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(&[u8])) {
        let mut rest = chunk;
        if std::mem::take(&mut self.skip_lf) {
            rest = rest.strip_prefix(b"\n").unwrap_or(rest);
        }
        while let Some(pos) = memchr::memchr2(b'\n', b'\r', rest) {
            let (head, tail) = rest.split_at(pos);
            rest = after_line_end(tail, &mut self.skip_lf);
            if self.discarding_line {
                self.discarding_line = false;
                self.line.clear();
                continue;
            }
            if let Some((data, blank)) = self.whole_event(head, rest) {
                // An event of one `data:` line and its blank line, both in this chunk (as vLLM
                // writes its events): handed over from the chunk, without a copy.
                on_event(data);
                rest = after_line_end(blank, &mut self.skip_lf);
                continue;
            }
            if self.line.is_empty() {
                self.handle_line(head, &mut on_event);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                self.handle_line(&line, &mut on_event);
                line.clear();
                self.line = line;
            }
        }
        if !rest.is_empty() && !self.discarding_line {
            if self.line.len() + rest.len() > self.max_event_bytes {
                self.line.clear();
                self.discarding_line = true;
                self.discarding_event = true;
            } else {
                self.line.extend_from_slice(rest);
            }
        }
    }

    /// `(data, the blank line's end and what follows)` when, with no line or event in progress,
    /// `line` (its line end taken off) is a `data:` field and `rest` begins with the line end of
    /// the blank line that dispatches it: what [`Self::handle_line`] would dispatch for the two
    /// lines, read from the chunk.
    fn whole_event<'c>(&self, line: &'c [u8], rest: &'c [u8]) -> Option<(&'c [u8], &'c [u8])> {
        if !self.line.is_empty() || self.has_data || self.discarding_event {
            return None;
        }
        let value = line.strip_prefix(b"data:")?;
        let value = value.strip_prefix(b" ").unwrap_or(value);
        let blank = matches!(rest.first(), Some(b'\n' | b'\r'));
        (blank && value.len() <= self.max_event_bytes).then_some((value, rest))
    }

    /// Events dropped because a line or the event exceeded the bound.
    pub fn dropped_events(&self) -> u64 {
        self.dropped_events
    }

    fn handle_line(&mut self, line: &[u8], on_event: &mut impl FnMut(&[u8])) {
        if line.is_empty() {
            if self.discarding_event {
                self.dropped_events += 1;
            } else if self.has_data {
                on_event(&self.data);
            }
            self.data.clear();
            self.has_data = false;
            self.discarding_event = false;
            return;
        }
        if line.first() == Some(&b':') || self.discarding_event {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let (f, v) = line.split_at(i);
                let v = v.get(1..).unwrap_or_default();
                (f, v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field != b"data" {
            return;
        }
        let extra = value.len() + usize::from(self.has_data);
        if self.data.len() + extra > self.max_event_bytes {
            self.data.clear();
            self.has_data = false;
            self.discarding_event = true;
            return;
        }
        if self.has_data {
            self.data.push(b'\n');
        }
        self.data.extend_from_slice(value);
        self.has_data = true;
    }
}

/// What follows the line end at the start of `tail` (a `\n`, a `\r\n`, or a bare `\r`); a `\r`
/// that ends the chunk sets `skip_lf`, as a `\n` that begins the next chunk completes it.
fn after_line_end<'c>(tail: &'c [u8], skip_lf: &mut bool) -> &'c [u8] {
    match tail {
        [b'\r', b'\n', rest @ ..] => rest,
        [b'\r'] => {
            *skip_lf = true;
            &[]
        }
        [_, rest @ ..] => rest,
        [] => tail,
    }
}

/// Longest `event:` value [`SseStream`] reports (longer ones are not reported).
pub const MAX_EVENT_NAME_BYTES: usize = 64;

/// What [`SseStream::feed`] reports, in stream order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SsePiece<'a> {
    /// Bytes of the current event's data: a piece of a `data:` line's value (one optional space
    /// after the colon removed, its line end not included), or the `\n` that joins a
    /// second `data:` line to the first. The pieces of one event, concatenated, are the data
    /// [`SseParser`] dispatches for it.
    Data(&'a [u8]),
    /// The value of an `event:` line, when at most [`MAX_EVENT_NAME_BYTES`].
    EventName(&'a [u8]),
    /// A blank line ended an event; `data` says whether it had a `data:` line (only such an event
    /// is dispatched, as by [`SseParser`]). The reader of the pieces starts a new event after it.
    EventEnd {
        /// Whether the event had at least one `data:` line.
        data: bool,
    },
}

/// Where [`SseStream`] is in the current line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LineState {
    /// At the start of a line.
    Start,
    /// Reading the field name (at most 5 bytes held: `event`).
    Field,
    /// Just after the colon of a `data:` line (one space may follow).
    DataColon,
    /// In a `data:` line's value.
    DataValue,
    /// Just after the colon of an `event:` line.
    NameColon,
    /// In an `event:` line's value.
    NameValue,
    /// In a comment or a field the stream does not report: skipped to the end of the line.
    Skip,
}

/// A Server-Sent Events reader that holds no event: the same format as [`SseParser`] (lines end
/// in `\n`, `\r\n` or a bare `\r`, `data:` lines joined with `\n`, comments and other fields
/// ignored, a blank line ends the event), but each event's data is handed on in pieces as the
/// bytes arrive ([`SsePiece`]), so an event of any size passes in O(1) memory: at most a 5-byte
/// field name and an [`MAX_EVENT_NAME_BYTES`] `event:` value. For streams whose events may be
/// large (the Responses API's `response.completed` carries the whole response), read by an
/// incremental JSON reader.
#[derive(Debug)]
pub struct SseStream {
    state: LineState,
    field: Vec<u8>,
    name: Vec<u8>,
    name_overflow: bool,
    has_data: bool,
    /// The last line ended in a `\r`: a `\n` right after it is part of that line end.
    skip_lf: bool,
}

impl Default for SseStream {
    fn default() -> Self {
        Self::new()
    }
}

impl SseStream {
    /// A reader at the start of a stream.
    pub fn new() -> Self {
        Self {
            state: LineState::Start,
            field: Vec::new(),
            name: Vec::new(),
            name_overflow: false,
            has_data: false,
            skip_lf: false,
        }
    }

    /// Feeds one chunk; calls `on` with each piece the chunk completes or carries.
    pub fn feed(&mut self, chunk: &[u8], mut on: impl FnMut(SsePiece<'_>)) {
        let mut rest = chunk;
        while !rest.is_empty() {
            if std::mem::take(&mut self.skip_lf) {
                if let Some(tail) = rest.strip_prefix(b"\n") {
                    rest = tail;
                    continue;
                }
            }
            rest = match self.state {
                LineState::DataValue => self.data_bytes(rest, &mut on),
                _ => {
                    let (&b, tail) = match rest.split_first() {
                        Some(x) => x,
                        None => break,
                    };
                    self.byte(b, &mut on);
                    tail
                }
            };
        }
    }

    /// Bytes of a data value up to the end of its line; returns the rest of the chunk.
    fn data_bytes<'a>(&mut self, rest: &'a [u8], on: &mut impl FnMut(SsePiece<'_>)) -> &'a [u8] {
        match memchr::memchr2(b'\n', b'\r', rest) {
            Some(pos) => {
                let (head, tail) = rest.split_at(pos);
                if !head.is_empty() {
                    on(SsePiece::Data(head));
                }
                self.state = LineState::Start;
                self.skip_lf = tail.first() == Some(&b'\r');
                tail.get(1..).unwrap_or_default()
            }
            None => {
                if !rest.is_empty() {
                    on(SsePiece::Data(rest));
                }
                &[]
            }
        }
    }

    /// One byte outside a data value.
    fn byte(&mut self, b: u8, on: &mut impl FnMut(SsePiece<'_>)) {
        let line_end = matches!(b, b'\n' | b'\r');
        if line_end {
            self.skip_lf = b == b'\r';
        }
        match self.state {
            LineState::Start if line_end => self.end_event(on),
            LineState::Start if b == b':' => self.state = LineState::Skip,
            LineState::Start => {
                self.field.clear();
                self.field.push(b);
                self.state = LineState::Field;
            }
            LineState::Field if line_end => {
                // A line without a colon: the whole line is the field name, and its value is
                // empty.
                match self.field.as_slice() {
                    b"data" => self.data_line_starts(on),
                    b"event" => on(SsePiece::EventName(b"")),
                    _ => {}
                }
                self.state = LineState::Start;
            }
            LineState::Field if b == b':' => {
                self.state = match self.field.as_slice() {
                    b"data" => {
                        self.data_line_starts(on);
                        LineState::DataColon
                    }
                    b"event" => {
                        self.name.clear();
                        self.name_overflow = false;
                        LineState::NameColon
                    }
                    _ => LineState::Skip,
                };
            }
            LineState::Field => {
                self.field.push(b);
                self.state = if self.field.len() > 5 { LineState::Skip } else { LineState::Field };
            }
            LineState::DataColon | LineState::DataValue if line_end => self.state = LineState::Start,
            LineState::DataColon if b == b' ' => self.state = LineState::DataValue,
            LineState::DataColon | LineState::DataValue => {
                self.state = LineState::DataValue;
                on(SsePiece::Data(&[b]));
            }
            LineState::NameColon | LineState::NameValue if line_end => {
                self.report_name(on);
                self.state = LineState::Start;
            }
            LineState::NameColon if b == b' ' => self.state = LineState::NameValue,
            LineState::NameColon | LineState::NameValue => {
                self.state = LineState::NameValue;
                if self.name.len() >= MAX_EVENT_NAME_BYTES {
                    self.name_overflow = true;
                } else {
                    self.name.push(b);
                }
            }
            LineState::Skip if line_end => self.state = LineState::Start,
            LineState::Skip => {}
        }
    }

    /// A `data:` line starts: join it to the event's earlier data with `\n`.
    fn data_line_starts(&mut self, on: &mut impl FnMut(SsePiece<'_>)) {
        if self.has_data {
            on(SsePiece::Data(b"\n"));
        }
        self.has_data = true;
    }

    fn report_name(&mut self, on: &mut impl FnMut(SsePiece<'_>)) {
        if !self.name_overflow {
            on(SsePiece::EventName(&self.name));
        }
        self.name.clear();
        self.name_overflow = false;
    }

    fn end_event(&mut self, on: &mut impl FnMut(SsePiece<'_>)) {
        on(SsePiece::EventEnd { data: self.has_data });
        self.has_data = false;
        self.state = LineState::Start;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_all(chunks: &[&[u8]], max: usize) -> (Vec<String>, u64) {
        let mut p = SseParser::new(max);
        let mut out = Vec::new();
        for c in chunks {
            p.feed(c, |d| out.push(String::from_utf8(d.to_vec()).unwrap()));
        }
        (out, p.dropped_events())
    }

    const STREAM: &[u8] = b": keep-alive\n\ndata: {\"a\":1}\n\ndata: {\"b\":2}\r\n\r\nevent: x\nid: 7\ndata: line1\ndata:line2\n\ndata: [DONE]\n\n";

    #[test]
    fn parses_every_case_in_one_chunk() {
        let (events, dropped) = parse_all(&[STREAM], 1024);
        assert_eq!(events, vec!["{\"a\":1}", "{\"b\":2}", "line1\nline2", "[DONE]"]);
        assert_eq!(dropped, 0);
    }

    #[test]
    fn same_events_at_every_split_point() {
        let (whole, _) = parse_all(&[STREAM], 1024);
        for i in 0..=STREAM.len() {
            for j in i..=STREAM.len() {
                let (a, rest) = STREAM.split_at(i);
                let (b, c) = rest.split_at(j - i);
                assert_eq!(parse_all(&[a, b, c], 1024).0, whole, "split at {i}/{j}");
            }
        }
    }

    #[test]
    fn byte_by_byte() {
        let chunks: Vec<&[u8]> = STREAM.chunks(1).collect();
        assert_eq!(parse_all(&chunks, 1024).0.len(), 4);
    }

    #[test]
    fn comment_only_and_field_only_events_dispatch_nothing() {
        assert!(parse_all(&[b": hi\n\nevent: ping\n\n"], 64).0.is_empty());
    }

    #[test]
    fn oversized_event_is_dropped_and_parsing_recovers() {
        let big = format!("data: {}\n\ndata: ok\n\n", "x".repeat(100));
        let (events, dropped) = parse_all(&[big.as_bytes()], 32);
        assert_eq!(events, vec!["ok"]);
        assert_eq!(dropped, 1);
        // Split across chunks: the partial line alone exceeds the bound.
        let (a, b) = big.as_bytes().split_at(50);
        let (events, dropped) = parse_all(&[a, b], 32);
        assert_eq!(events, vec!["ok"]);
        assert_eq!(dropped, 1);
    }

    #[test]
    fn multi_line_data_over_the_bound_is_dropped() {
        let s = format!("data: {}\ndata: {}\n\ndata: ok\n\n", "a".repeat(20), "b".repeat(20));
        let (events, dropped) = parse_all(&[s.as_bytes()], 32);
        assert_eq!(events, vec!["ok"]);
        assert_eq!(dropped, 1);
    }

    #[test]
    fn incomplete_event_at_end_is_not_dispatched() {
        assert!(parse_all(&[b"data: partial\n"], 64).0.is_empty());
    }

    /// The events [`SseStream`] dispatches (data pieces joined) and the event names it reported.
    fn stream_all(chunks: &[&[u8]]) -> (Vec<String>, Vec<String>) {
        let mut s = SseStream::new();
        let (mut events, mut names, mut data) = (Vec::new(), Vec::new(), Vec::new());
        for c in chunks {
            s.feed(c, |piece| match piece {
                SsePiece::Data(d) => data.extend_from_slice(d),
                SsePiece::EventName(n) => names.push(String::from_utf8(n.to_vec()).unwrap()),
                SsePiece::EventEnd { data: had } => {
                    if had {
                        events.push(String::from_utf8(std::mem::take(&mut data)).unwrap());
                    }
                    assert!(data.is_empty(), "data without a data line");
                }
            });
        }
        (events, names)
    }

    const TYPED: &[u8] = b"event: response.created\ndata: {\"type\":\"response.created\"}\n\nevent:x\r\ndata:\r\ndata: a\rb\r\n\r\n:c\nevent\ndata\n\nid: 1\nretry: 5\nevents: no\ndatum: no\n\n";

    #[test]
    fn the_stream_reader_dispatches_what_the_parser_does_at_every_split() {
        for body in [STREAM, TYPED] {
            let (whole, _) = parse_all(&[body], 1024);
            for i in 0..=body.len() {
                for j in i..=body.len() {
                    let (a, rest) = body.split_at(i);
                    let (b, c) = rest.split_at(j - i);
                    assert_eq!(stream_all(&[a, b, c]).0, whole, "split at {i}/{j}");
                }
            }
        }
        let (events, names) = stream_all(&[TYPED]);
        // A bare `\r` ends a line: `b` is a line of its own (a field the stream ignores).
        assert_eq!(events, vec!["{\"type\":\"response.created\"}", "\na", ""]);
        assert_eq!(names, vec!["response.created", "x", ""]);
        let bytes: Vec<&[u8]> = TYPED.chunks(1).collect();
        assert_eq!(stream_all(&bytes), (events, names));
    }

    /// The same events whatever the line ends (`\n`, `\r\n`, a bare `\r`, and mixes), at every
    /// split of the stream into three chunks, by both readers.
    const LINE_ENDS: &[u8] =
        b"data: {\"a\":1}\r\rdata: {\"b\":2}\r\n\rdata: l1\rdata: l2\n\r\n: c\revent: e\rdata: [DONE]\r\r";

    #[test]
    fn a_bare_carriage_return_ends_a_line() {
        let expected = vec!["{\"a\":1}", "{\"b\":2}", "l1\nl2", "[DONE]"];
        assert_eq!(parse_all(&[LINE_ENDS], 1024).0, expected);
        for i in 0..=LINE_ENDS.len() {
            for j in i..=LINE_ENDS.len() {
                let (a, rest) = LINE_ENDS.split_at(i);
                let (b, c) = rest.split_at(j - i);
                assert_eq!(parse_all(&[a, b, c], 1024).0, expected, "split at {i}/{j}");
                assert_eq!(stream_all(&[a, b, c]).0, expected, "split at {i}/{j}");
            }
        }
        // A `\r` that ends a chunk and the `\n` that begins the next are one line end, not two
        // (which would dispatch the event early and make the next line part of another).
        assert_eq!(parse_all(&[b"data: a\r", b"\ndata: b\r", b"\n\r\n"], 64).0, vec!["a\nb"]);
        assert_eq!(stream_all(&[b"data: a\r", b"\ndata: b\r", b"\n\r\n"]).0, vec!["a\nb"]);
    }

    #[test]
    fn the_stream_reader_holds_no_event() {
        let big = format!("event: e\ndata: {}\n\ndata: ok\n\n", "x".repeat(1 << 20));
        let mut s = SseStream::new();
        let mut sizes = Vec::new();
        let mut current = 0usize;
        for c in big.as_bytes().chunks(4096) {
            s.feed(c, |piece| match piece {
                SsePiece::Data(d) => current += d.len(),
                SsePiece::EventEnd { data: true } => sizes.push(std::mem::take(&mut current)),
                _ => {}
            });
            assert!(s.field.capacity() <= 16 && s.name.capacity() <= 2 * MAX_EVENT_NAME_BYTES);
        }
        assert_eq!(sizes, vec![1 << 20, 2]);
    }

    #[test]
    fn long_event_names_are_not_reported() {
        let at_bound = "n".repeat(MAX_EVENT_NAME_BYTES);
        let over = "n".repeat(MAX_EVENT_NAME_BYTES + 1);
        let body = format!("event: {at_bound}\r\nevent: {over}\nevent: {over}\r\ndata: x\n\n");
        for split in 0..=body.len() {
            let (a, b) = body.as_bytes().split_at(split);
            assert_eq!(stream_all(&[a, b]), (vec!["x".to_string()], vec![at_bound.clone()]), "split {split}");
        }
    }
}
