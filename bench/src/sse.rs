//! Incremental Server-Sent Events parser that extracts the timing-relevant
//! facts from an OpenAI-compatible streaming response.
//!
//! The parser is pure (no clock, no I/O): the caller feeds body bytes exactly
//! as they arrive, in arbitrary splits, and [`SseParser::feed`] returns how
//! many *content-token events* were completed by that chunk. The caller
//! timestamps the chunk and attributes that instant to each returned event
//! (TTFT for the first, inter-token gaps for the rest).
//!
//! Framing rules (a subset of the WHATWG SSE grammar, which is all OpenAI
//! and vLLM servers emit):
//! * lines end with `\n`; a trailing `\r` is stripped, so `\r\n` works too
//!   (bare-`\r` line endings are not supported);
//! * an event ends at a blank line (`\n\n` or `\r\n\r\n`);
//! * `data:` lines (one optional space after the colon) are concatenated
//!   with `\n`; lines starting with `:` are comments; other fields
//!   (`event:`, `id:`, `retry:`) are ignored;
//! * an event whose data is `[DONE]` marks the clean end of the stream.
//!
//! An event is a *content token* when its JSON payload has a non-empty
//! `choices[0].delta.content` (chat completions), `choices[0].text`
//! (completions), or `choices[0].delta.reasoning_content` /
//! `choices[0].delta.reasoning` (reasoning models served by vLLM).
//! A `usage` object anywhere in the stream (the last one wins) provides
//! prompt and completion token counts. A payload carrying a top-level
//! `error` object is recorded as an in-band error.
//!
//! Steady-state parsing performs no heap allocation per event: the line and
//! data buffers are reused and the JSON is deserialized into borrowed,
//! fact-only structs (strings are inspected, never copied).

use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// Token counts reported by the server's `usage` object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// `usage.prompt_tokens` (tokens), if present.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens` (tokens), if present.
    pub completion_tokens: Option<u64>,
}

/// Incremental SSE parser; see the module documentation for the rules.
#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes of an incomplete line carried over from the previous chunk.
    line_buf: Vec<u8>,
    /// Accumulated `data:` payload of the event being built.
    data_buf: Vec<u8>,
    /// Whether the event being built has at least one `data:` line.
    has_data: bool,
    done: bool,
    error_event: bool,
    usage: Option<Usage>,
    content_events: u64,
    parse_errors: u64,
}

impl SseParser {
    /// Creates an empty parser.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds the next slice of the response body and returns the number of
    /// content-token events completed by it (0 or more).
    pub fn feed(&mut self, chunk: &[u8]) -> u32 {
        let mut tokens = 0u32;
        let mut rest = chunk;
        if !self.line_buf.is_empty() {
            match memchr(b'\n', rest) {
                Some(pos) => {
                    let (head, tail) = rest.split_at(pos);
                    self.line_buf.extend_from_slice(head);
                    rest = tail.get(1..).unwrap_or_default();
                    let line = std::mem::take(&mut self.line_buf);
                    tokens += self.process_line(&line);
                    self.line_buf = line;
                    self.line_buf.clear();
                }
                None => {
                    self.line_buf.extend_from_slice(rest);
                    return tokens;
                }
            }
        }
        while let Some(pos) = memchr(b'\n', rest) {
            let (line, tail) = rest.split_at(pos);
            tokens += self.process_line(line);
            rest = tail.get(1..).unwrap_or_default();
        }
        self.line_buf.extend_from_slice(rest);
        tokens
    }

    /// Signals the end of the body. Leniently processes a final line without
    /// a newline and dispatches a pending event without its blank line
    /// (strict SSE would discard it). Returns content-token events completed.
    pub fn finish(&mut self) -> u32 {
        let mut tokens = 0;
        if !self.line_buf.is_empty() {
            let line = std::mem::take(&mut self.line_buf);
            tokens += self.process_line(&line);
        }
        tokens + self.dispatch()
    }

    /// Whether a `data: [DONE]` event was seen.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Whether an event carried a top-level `error` object.
    pub fn error_event(&self) -> bool {
        self.error_event
    }

    /// The last `usage` object seen, if any.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// Total content-token events seen so far.
    pub fn content_events(&self) -> u64 {
        self.content_events
    }

    /// Number of events whose data was neither `[DONE]` nor valid JSON.
    pub fn parse_errors(&self) -> u64 {
        self.parse_errors
    }

    fn process_line(&mut self, line: &[u8]) -> u32 {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.is_empty() {
            return self.dispatch();
        }
        if line.first() == Some(&b':') {
            return 0;
        }
        let (field, value) = match memchr(b':', line) {
            Some(pos) => {
                let (f, v) = line.split_at(pos);
                let v = v.get(1..).unwrap_or_default();
                (f, v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        if field == b"data" {
            if self.has_data {
                self.data_buf.push(b'\n');
            }
            self.data_buf.extend_from_slice(value);
            self.has_data = true;
        }
        0
    }

    fn dispatch(&mut self) -> u32 {
        if !self.has_data {
            return 0;
        }
        self.has_data = false;
        let data = self.data_buf.trim_ascii();
        let mut token = 0;
        if data == b"[DONE]" {
            self.done = true;
        } else {
            match serde_json::from_slice::<StreamChunk>(data) {
                Ok(chunk) => {
                    if chunk.choices.0 {
                        token = 1;
                        self.content_events += 1;
                    }
                    if let Some(u) = chunk.usage {
                        self.usage = Some(Usage {
                            prompt_tokens: u.prompt_tokens,
                            completion_tokens: u.completion_tokens,
                        });
                    }
                    if chunk.error.is_some() {
                        self.error_event = true;
                    }
                }
                Err(_) => self.parse_errors += 1,
            }
        }
        self.data_buf.clear();
        token
    }
}

fn memchr(needle: u8, haystack: &[u8]) -> Option<usize> {
    haystack.iter().position(|&b| b == needle)
}

#[derive(Deserialize)]
struct StreamChunk {
    #[serde(default)]
    choices: FirstChoiceHasContent,
    #[serde(default)]
    usage: Option<RawUsage>,
    #[serde(default)]
    error: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
}

#[derive(Deserialize, Default)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    text: Option<NonEmpty>,
}

#[derive(Deserialize, Default)]
struct Delta {
    #[serde(default)]
    content: Option<NonEmpty>,
    #[serde(default)]
    reasoning_content: Option<NonEmpty>,
    #[serde(default)]
    reasoning: Option<NonEmpty>,
}

impl Choice {
    fn has_content(&self) -> bool {
        let text = self.text.as_ref().is_some_and(|t| t.0);
        let delta = self.delta.as_ref().is_some_and(|d| {
            [&d.content, &d.reasoning_content, &d.reasoning].iter().any(|f| f.as_ref().is_some_and(|v| v.0))
        });
        text || delta
    }
}

/// `choices` array reduced to "does the first choice carry content".
#[derive(Default)]
struct FirstChoiceHasContent(bool);

impl<'de> Deserialize<'de> for FirstChoiceHasContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FirstChoiceHasContent;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a choices array or null")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(FirstChoiceHasContent(false))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(FirstChoiceHasContent(false))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let first = seq.next_element::<Choice>()?;
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(FirstChoiceHasContent(first.is_some_and(|c| c.has_content())))
            }
        }
        d.deserialize_any(V)
    }
}

/// A JSON value reduced to "is a non-empty string (or non-empty array)".
struct NonEmpty(bool);

impl<'de> Deserialize<'de> for NonEmpty {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = NonEmpty;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, array or null")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(NonEmpty(!v.is_empty()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(NonEmpty(false))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut any = false;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    any = true;
                }
                Ok(NonEmpty(any))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(NonEmpty(false))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_stream(tokens: &[&str], sep: &str) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "data: {{\"id\":\"x\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}}}}]}}{sep}{sep}"
        ));
        for t in tokens {
            s.push_str(&format!(
                "data: {{\"id\":\"x\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"finish_reason\":null}}],\"usage\":null}}{sep}{sep}",
                serde_json::to_string(t).unwrap()
            ));
        }
        s.push_str(&format!(
            ": keep-alive comment{sep}data: {{\"id\":\"x\",\"choices\":[],\"usage\":{{\"prompt_tokens\":7,\"completion_tokens\":{},\"total_tokens\":99}}}}{sep}{sep}data: [DONE]{sep}{sep}",
            tokens.len()
        ));
        s
    }

    fn feed_split(bytes: &[u8], sizes: &mut dyn FnMut() -> usize) -> (SseParser, u64) {
        let mut p = SseParser::new();
        let mut total = 0u64;
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = sizes().clamp(1, rest.len());
            let (a, b) = rest.split_at(n);
            total += u64::from(p.feed(a));
            rest = b;
        }
        total += u64::from(p.finish());
        (p, total)
    }

    #[test]
    fn parses_whole_stream() {
        let s = chat_stream(&["Hello", " world", "\n\"quoted\"", "é"], "\n");
        let mut p = SseParser::new();
        let n = p.feed(s.as_bytes());
        assert_eq!(n, 4);
        assert_eq!(p.finish(), 0);
        assert!(p.done());
        assert!(!p.error_event());
        assert_eq!(p.parse_errors(), 0);
        assert_eq!(p.usage(), Some(Usage { prompt_tokens: Some(7), completion_tokens: Some(4) }));
    }

    #[test]
    fn every_split_point_and_byte_by_byte() {
        for sep in ["\n", "\r\n"] {
            let s = chat_stream(&["a", "b", "c", "d", "e"], sep);
            let bytes = s.as_bytes();
            // Two-way split at every position.
            for cut in 0..=bytes.len() {
                let mut p = SseParser::new();
                let (a, b) = bytes.split_at(cut);
                let n = p.feed(a) + p.feed(b) + p.finish();
                assert_eq!(n, 5, "cut at {cut} sep {sep:?}");
                assert!(p.done());
                assert_eq!(p.usage().and_then(|u| u.completion_tokens), Some(5));
            }
            // One byte at a time.
            let (p, n) = feed_split(bytes, &mut || 1);
            assert_eq!(n, 5);
            assert!(p.done());
            // Pseudo-random split sizes.
            let mut state = 12345u64;
            let (p, n) = feed_split(bytes, &mut || {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % 40) as usize + 1
            });
            assert_eq!(n, 5);
            assert!(p.done());
        }
    }

    #[test]
    fn tokens_attributed_to_completing_chunk() {
        let ev = "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n";
        let mut p = SseParser::new();
        // The event is not complete until the blank line arrives.
        assert_eq!(p.feed(&ev.as_bytes()[..ev.len() - 1]), 0);
        assert_eq!(p.feed(b"\n"), 1);
        // Two events in one chunk count twice.
        let two = format!("{ev}{ev}");
        assert_eq!(p.feed(two.as_bytes()), 2);
        assert_eq!(p.content_events(), 3);
        assert!(!p.done());
    }

    #[test]
    fn completions_text_and_empty_content() {
        let s = "data: {\"choices\":[{\"text\":\"\"}]}\n\n\
                 data: {\"choices\":[{\"text\":\"hi\"}]}\n\n\
                 data: {\"choices\":[{\"delta\":{\"content\":null}}]}\n\n\
                 data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hmm\"}}]}\n\n\
                 data: {\"choices\":[{\"text\":\"a\"},{\"text\":\"b\"}]}\n\n\
                 data:[DONE]\n\n";
        let mut p = SseParser::new();
        assert_eq!(p.feed(s.as_bytes()), 3);
        assert!(p.done());
        assert_eq!(p.usage(), None);
    }

    #[test]
    fn multi_line_data_comments_other_fields_and_errors() {
        let s = "event: message\nid: 1\n: comment\ndata: {\"choices\":\ndata: [{\"text\":\"x\"}]}\n\n\
                 data: not json\n\n\
                 data: {\"error\":{\"message\":\"boom\",\"code\":500}}\n\n";
        let mut p = SseParser::new();
        assert_eq!(p.feed(s.as_bytes()), 1);
        assert_eq!(p.parse_errors(), 1);
        assert!(p.error_event());
        assert!(!p.done());
    }

    #[test]
    fn lenient_finish_without_trailing_blank_line() {
        let mut p = SseParser::new();
        assert_eq!(p.feed(b"data: {\"choices\":[{\"text\":\"x\"}]}\n\ndata: [DONE]"), 1);
        assert!(!p.done());
        assert_eq!(p.finish(), 0);
        assert!(p.done());
    }
}
