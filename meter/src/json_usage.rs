//! An incremental scanner that finds the top-level `usage` member of a JSON response body (an
//! OpenAI `chat.completion` or `text_completion` object) without holding the body: fed arbitrary
//! chunk boundaries, it keeps only its position in the JSON grammar (nesting depth, inside a
//! string, after a backslash), the current top-level key (at most [`MAX_KEY_BYTES`]) and the raw
//! bytes of the `usage` value (at most the bound it is given), which it parses with serde_json when
//! the value ends. Work is one pass over the body (O(n)); memory is O(bound) whatever the body's
//! size (a 20 MB body of `logprobs` is metered in a few KiB).
//!
//! It follows RFC 8259's structure only as far as it needs: strings (with `\` escapes, so quotes
//! and braces inside a string, such as a `content` that quotes `"usage":{...}`, are never taken for
//! structure), objects and arrays; it does not validate the rest of the body. Its answer equals
//! serde_json's reading of the whole body (`{"usage": {...}}` into an optional usage) for every
//! valid JSON object, and is `None` where serde_json would fail on the member itself: a `usage`
//! that is not an object of non-negative integers, `null`, larger than the bound, or given twice
//! (serde's duplicate-field error). A top-level value that is not an object has no `usage`.

/// Largest `usage` value (its raw JSON bytes) the meter holds by default: vLLM's object with
/// `prompt_tokens_details` is under 200 bytes.
pub const MAX_USAGE_BYTES: usize = 4096;

/// Largest top-level key held to compare with `usage` (longer keys are not `usage`, even escaped).
pub const MAX_KEY_BYTES: usize = 64;

/// Where the scanner is in the top-level object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Before the top-level value.
    Start,
    /// In the top-level object, before a key (or its closing `}`).
    Key,
    /// Inside a top-level key string.
    InKey,
    /// After a key, before its `:`.
    Colon,
    /// After the `:`, before the value's first byte.
    BeforeValue,
    /// Inside a member's value (`depth` counts its nesting).
    Value,
    /// The top-level object closed: nothing more to learn.
    Done,
    /// Not an object, or malformed where it matters: nothing more to learn.
    Invalid,
}

/// What [`Members::feed`] reports, in body order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Piece<'a> {
    /// A top-level member's key ended (its value follows): the raw bytes between its quotes
    /// (escapes not decoded), `None` when longer than [`MAX_KEY_BYTES`].
    Key(Option<&'a [u8]>),
    /// Raw bytes of the current member's value (from its first byte; whitespace after it, before
    /// the next `,` or `}`, included).
    Value(&'a [u8]),
    /// The current member's value ended.
    End,
}

/// The walk over a JSON body's top-level object: where it is in the grammar (nesting depth,
/// inside a string, after a backslash) and the current key (at most [`MAX_KEY_BYTES`]); the
/// members' values are handed on as [`Piece`]s, never held.
#[derive(Debug)]
pub(crate) struct Members {
    phase: Phase,
    /// Nesting inside the current member's value (0: at the value itself).
    depth: u32,
    in_string: bool,
    escape: bool,
    /// Raw bytes of the current top-level key (without quotes), up to [`MAX_KEY_BYTES`].
    key: Vec<u8>,
    key_overflow: bool,
}

impl Members {
    pub(crate) fn new() -> Self {
        Self {
            phase: Phase::Start,
            depth: 0,
            in_string: false,
            escape: false,
            key: Vec::new(),
            key_overflow: false,
        }
    }

    /// Whether more bytes can be reported (false once the top-level object closed or the body is
    /// not an object).
    pub(crate) fn wants_more(&self) -> bool {
        !matches!(self.phase, Phase::Done | Phase::Invalid)
    }

    /// Feeds the next bytes of the body.
    pub(crate) fn feed(&mut self, chunk: &[u8], on: &mut impl FnMut(Piece<'_>)) {
        let mut rest = chunk;
        while !rest.is_empty() && self.wants_more() {
            rest = if self.in_string { self.string_bytes(rest, on) } else { self.structure_bytes(rest, on) };
        }
    }

    /// Consumes bytes inside a string up to and including its closing quote; returns the rest.
    fn string_bytes<'a>(&mut self, rest: &'a [u8], on: &mut impl FnMut(Piece<'_>)) -> &'a [u8] {
        if self.escape {
            self.escape = false;
            let Some((_, tail)) = rest.split_first() else { return rest };
            self.keep(rest.get(..1).unwrap_or_default(), on);
            return tail;
        }
        let pos = rest.iter().position(|&b| b == b'"' || b == b'\\').unwrap_or(rest.len());
        let (head, tail) = rest.split_at(pos);
        self.keep(head, on);
        let Some((&mark, after)) = tail.split_first() else { return tail };
        if mark == b'\\' {
            self.escape = true;
            self.keep(tail.get(..1).unwrap_or_default(), on);
        } else {
            self.in_string = false;
            if self.phase == Phase::InKey {
                self.phase = Phase::Colon;
            } else {
                self.keep(tail.get(..1).unwrap_or_default(), on);
            }
        }
        after
    }

    /// Consumes structural bytes (outside strings) until a string starts or the object closes.
    fn structure_bytes<'a>(&mut self, rest: &'a [u8], on: &mut impl FnMut(Piece<'_>)) -> &'a [u8] {
        let mut i = 0;
        while let Some(&b) = rest.get(i) {
            let this = rest.get(i..=i).unwrap_or_default();
            i += 1;
            match self.phase {
                Phase::Start => match b {
                    b'{' => self.phase = Phase::Key,
                    b' ' | b'\t' | b'\n' | b'\r' => {}
                    _ => self.phase = Phase::Invalid,
                },
                Phase::Key => match b {
                    b'"' => {
                        self.phase = Phase::InKey;
                        self.in_string = true;
                        self.key.clear();
                        self.key_overflow = false;
                    }
                    b'}' => self.phase = Phase::Done,
                    b' ' | b'\t' | b'\n' | b'\r' => {}
                    _ => self.phase = Phase::Invalid,
                },
                Phase::Colon => match b {
                    b':' => {
                        self.phase = Phase::BeforeValue;
                        on(Piece::Key((!self.key_overflow).then_some(self.key.as_slice())));
                    }
                    b' ' | b'\t' | b'\n' | b'\r' => {}
                    _ => self.phase = Phase::Invalid,
                },
                Phase::BeforeValue => match b {
                    b' ' | b'\t' | b'\n' | b'\r' => {}
                    _ => {
                        self.phase = Phase::Value;
                        self.depth = 0;
                        i -= 1;
                    }
                },
                Phase::Value => match b {
                    b',' | b'}' if self.depth == 0 => {
                        on(Piece::End);
                        self.phase = if b == b',' { Phase::Key } else { Phase::Done };
                    }
                    b'"' => {
                        self.in_string = true;
                        self.keep(this, on);
                    }
                    b'{' | b'[' => {
                        self.depth = self.depth.saturating_add(1);
                        self.keep(this, on);
                    }
                    b'}' | b']' => {
                        self.depth = self.depth.saturating_sub(1);
                        self.keep(this, on);
                    }
                    _ => self.keep(this, on),
                },
                Phase::InKey | Phase::Done | Phase::Invalid => {}
            }
            if self.in_string || !self.wants_more() {
                break;
            }
        }
        rest.get(i..).unwrap_or_default()
    }

    /// Keeps bytes of the current key (within its bound), or reports bytes of a member's value.
    fn keep(&mut self, bytes: &[u8], on: &mut impl FnMut(Piece<'_>)) {
        if self.phase == Phase::InKey {
            if self.key_overflow || self.key.len().saturating_add(bytes.len()) > MAX_KEY_BYTES {
                self.key_overflow = true;
            } else {
                self.key.extend_from_slice(bytes);
            }
        } else if self.phase == Phase::Value && !bytes.is_empty() {
            on(Piece::Value(bytes));
        }
    }
}

/// Whether a raw key (escapes not decoded, as [`Piece::Key`] gives it) is `name`, escapes decoded
/// as serde_json does.
pub(crate) fn key_is(raw: Option<&[u8]>, name: &str) -> bool {
    let Some(raw) = raw else { return false };
    if !raw.contains(&b'\\') {
        return raw == name.as_bytes();
    }
    let mut quoted = Vec::with_capacity(raw.len().saturating_add(2));
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted).is_ok_and(|k| k == name)
}

/// The raw bytes of one member's value, up to a bound.
#[derive(Debug)]
pub(crate) struct Capture {
    bytes: Vec<u8>,
    overflow: bool,
    max: usize,
}

impl Capture {
    pub(crate) fn new(max: usize) -> Self {
        Self { bytes: Vec::new(), overflow: false, max }
    }

    pub(crate) fn clear(&mut self) {
        self.bytes.clear();
        self.overflow = false;
    }

    pub(crate) fn push(&mut self, bytes: &[u8]) {
        if self.overflow {
            return;
        }
        if self.bytes.len().saturating_add(bytes.len()) > self.max {
            self.overflow = true;
            self.bytes = Vec::new();
        } else {
            self.bytes.extend_from_slice(bytes);
        }
    }

    /// The bytes held, `None` after an overflow.
    pub(crate) fn get(&self) -> Option<&[u8]> {
        (!self.overflow).then_some(self.bytes.as_slice())
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.bytes.capacity()
    }
}

/// What the scan found of the `usage` member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found<U> {
    /// No `usage` member (yet).
    None,
    /// One `usage` member, parsed (`None`: null, unreadable or over the bound).
    One(Option<U>),
    /// More than one: serde_json refuses the body.
    Duplicate,
}

/// Incremental scanner state for one body; `U` is what the `usage` value is parsed into.
#[derive(Debug)]
pub struct UsageScanner<U> {
    members: Members,
    /// Whether the current member is `usage` (its value is being captured).
    capturing: bool,
    capture: Capture,
    found: Found<U>,
}

impl<U: serde::de::DeserializeOwned + Copy> UsageScanner<U> {
    /// A scanner that holds at most `max_usage_bytes` of the `usage` value (a larger one reads as
    /// no usage).
    pub fn new(max_usage_bytes: usize) -> Self {
        Self {
            members: Members::new(),
            capturing: false,
            capture: Capture::new(max_usage_bytes),
            found: Found::None,
        }
    }

    /// Whether more bytes can change the answer (false once the top-level object closed or the
    /// body is not an object).
    pub fn wants_more(&self) -> bool {
        self.members.wants_more()
    }

    /// The `usage` member's value, once it ended (whether or not the body did); `None` when there
    /// is none, it is `null` or unreadable, or it was given twice.
    pub fn usage(&self) -> Option<U> {
        match self.found {
            Found::One(u) => u,
            Found::None | Found::Duplicate => None,
        }
    }

    /// Whether the body gave its top-level `usage` member more than once (serde_json refuses such
    /// a body; the meter reads its usage as unreadable, [`crate::UnreadUsage::Duplicate`]).
    pub fn duplicate(&self) -> bool {
        matches!(self.found, Found::Duplicate)
    }

    /// Feeds the next bytes of the body.
    pub fn feed(&mut self, chunk: &[u8]) {
        let Self { members, capturing, capture, found } = self;
        members.feed(chunk, &mut |piece| match piece {
            Piece::Key(key) => {
                *capturing = key_is(key, "usage");
                capture.clear();
            }
            Piece::Value(bytes) => {
                if *capturing {
                    capture.push(bytes);
                }
            }
            Piece::End => {
                if !std::mem::take(capturing) {
                    return;
                }
                let parsed =
                    capture.get().and_then(|b| serde_json::from_slice::<Option<U>>(b).ok().flatten());
                capture.clear();
                *found = match *found {
                    Found::None => Found::One(parsed),
                    Found::One(_) | Found::Duplicate => Found::Duplicate,
                };
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
    struct U {
        #[serde(default)]
        prompt_tokens: u64,
        #[serde(default)]
        completion_tokens: u64,
    }

    #[derive(Deserialize)]
    struct Whole {
        #[serde(default)]
        usage: Option<U>,
    }

    fn whole(body: &[u8]) -> Option<U> {
        serde_json::from_slice::<Whole>(body).ok().and_then(|w| w.usage)
    }

    fn scan(parts: &[&[u8]]) -> Option<U> {
        let mut s = UsageScanner::<U>::new(MAX_USAGE_BYTES);
        for p in parts {
            s.feed(p);
        }
        s.usage()
    }

    /// A small deterministic generator (xorshift), so failures reproduce.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    const BODIES: &[&str] = &[
        r#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}"#,
        r#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"choices":[]}"#,
        " \n{ \"a\" : [1, {\"b\": \"}\"}], \"usage\" :\t{ \"prompt_tokens\" : 3 , \"completion_tokens\":4 } \r\n} ",
        r#"{"choices":[{"message":{"content":"she said \"usage\":{\"prompt_tokens\":99} and {\"usage\": 1}"}}],"usage":{"prompt_tokens":5,"completion_tokens":6}}"#,
        r#"{"choices":[{"message":{"usage":{"prompt_tokens":99,"completion_tokens":99}}}],"x":{"usage":{"prompt_tokens":98}},"usage":{"prompt_tokens":5,"completion_tokens":1}}"#,
        r#"{"escaped\\":"\\","u\"sage":{"prompt_tokens":9},"usage":{"completion_tokens":8}}"#,
        r#"{"\u0075sage":{"prompt_tokens":2,"completion_tokens":3}}"#,
        r#"{"usage":null}"#,
        r#"{"usage":{"prompt_tokens":-1}}"#,
        r#"{"usage":"ten"}"#,
        r#"{"usage":{"prompt_tokens":1},"usage":{"prompt_tokens":2}}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1}},"n":[[[]]],"t":true,"f":null,"num":-1.5e3}"#,
        r#"{}"#,
        r#"[{"usage":{"prompt_tokens":1}}]"#,
        r#"{"error":{"message":"bad","type":"BadRequestError","code":400}}"#,
    ];

    #[test]
    fn equals_serde_json_at_every_split() {
        for body in BODIES {
            let b = body.as_bytes();
            let expected = whole(b);
            if !body.starts_with('[') {
                assert_eq!(scan(&[b]), expected, "{body}");
            }
            for split in 0..=b.len() {
                let (x, y) = b.split_at(split);
                if body.starts_with('[') {
                    assert_eq!(scan(&[x, y]), None, "an array has no top-level usage");
                } else {
                    assert_eq!(scan(&[x, y]), expected, "{body} split at {split}");
                }
            }
        }
        assert_eq!(whole(BODIES[3].as_bytes()), Some(U { prompt_tokens: 5, completion_tokens: 6 }));
        assert_eq!(whole(BODIES[6].as_bytes()), Some(U { prompt_tokens: 2, completion_tokens: 3 }));
    }

    #[test]
    fn equals_serde_json_at_random_splits() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for body in BODIES.iter().filter(|b| !b.starts_with('[')) {
            let b = body.as_bytes();
            for _ in 0..200 {
                let mut parts = Vec::new();
                let mut at = 0;
                while at < b.len() {
                    let len = 1 + (rng.next() % 9) as usize;
                    let end = (at + len).min(b.len());
                    parts.push(&b[at..end]);
                    at = end;
                }
                assert_eq!(scan(&parts), whole(b), "{body}");
            }
        }
    }

    #[test]
    fn one_byte_at_a_time() {
        for body in BODIES.iter().filter(|b| !b.starts_with('[')) {
            let parts: Vec<&[u8]> = body.as_bytes().chunks(1).collect();
            assert_eq!(scan(&parts), whole(body.as_bytes()), "{body}");
        }
    }

    #[test]
    fn an_oversized_usage_reads_as_none_and_stays_bounded() {
        let big = format!(r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}}}}"#, "x".repeat(10_000));
        let mut s = UsageScanner::<U>::new(MAX_USAGE_BYTES);
        s.feed(big.as_bytes());
        assert_eq!(s.usage(), None);
        assert!(s.capture.capacity() <= MAX_USAGE_BYTES);
        assert!(!s.wants_more());
    }

    #[test]
    fn a_long_key_is_not_usage() {
        let body = format!(r#"{{"{}usage":{{"prompt_tokens":1}}}}"#, "k".repeat(100));
        assert_eq!(scan(&[body.as_bytes()]), None);
        assert_eq!(whole(body.as_bytes()), None);
    }

    #[test]
    fn a_truncated_body_keeps_a_usage_that_ended() {
        let body = br#"{"usage":{"prompt_tokens":1,"completion_tokens":2},"choices":[{"mess"#;
        assert_eq!(scan(&[body]), Some(U { prompt_tokens: 1, completion_tokens: 2 }));
        let cut = br#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2"#;
        assert_eq!(scan(&[cut]), None, "a usage that never ended is not read");
    }

    #[test]
    fn a_20_mb_body_is_scanned_in_bounded_memory() {
        // vLLM's chat `logprobs`: one entry per token with its top_logprobs.
        let entry = r#"{"token":"the","logprob":-0.25,"bytes":[116,104,101],"top_logprobs":[{"token":"the","logprob":-0.25,"bytes":[116,104,101]},{"token":"\"}{","logprob":-3.5,"bytes":[34,125,123]}]},"#;
        let mut s = UsageScanner::<U>::new(MAX_USAGE_BYTES);
        s.feed(br#"{"id":"chatcmpl-1","choices":[{"index":0,"message":{"role":"assistant","content":"the"},"logprobs":{"content":["#);
        let chunk = entry.repeat(64 * 1024 / entry.len());
        let mut fed = 0usize;
        while fed < 20_000_000 {
            s.feed(chunk.as_bytes());
            fed += chunk.len();
            assert!(s.members.key.capacity() <= MAX_KEY_BYTES && s.capture.capacity() <= MAX_USAGE_BYTES);
        }
        s.feed(br#"{"token":"x","logprob":0}]},"finish_reason":"length"}],"usage":{"prompt_tokens":12,"completion_tokens":163840}}"#);
        assert_eq!(s.usage(), Some(U { prompt_tokens: 12, completion_tokens: 163_840 }));
        assert!(!s.wants_more());
    }
}
