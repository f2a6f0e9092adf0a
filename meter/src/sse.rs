//! An incremental Server-Sent Events parser, fed arbitrary chunk boundaries, bounded in memory.
//!
//! It follows the WHATWG event-stream format as OpenAI-compatible servers (vLLM) use it: lines
//! end in `\n` or `\r\n`; a blank line dispatches the event; `data:` lines (one optional space
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
        }
    }

    /// Feeds one chunk; calls `on_event` with the data of every event the chunk completes.
    pub fn feed(&mut self, chunk: &[u8], mut on_event: impl FnMut(&[u8])) {
        let mut rest = chunk;
        while let Some(pos) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(pos);
            rest = tail.get(1..).unwrap_or_default();
            if self.discarding_line {
                self.discarding_line = false;
                self.line.clear();
                continue;
            }
            if self.line.is_empty() {
                self.handle_line(strip_cr(head), &mut on_event);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(head);
                self.handle_line(strip_cr(&line), &mut on_event);
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

fn strip_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
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
}
