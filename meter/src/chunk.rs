//! The fast reading of a chat or completions stream chunk: the content events that make up almost
//! all of a stream only need their content counted, not parsed into values.
//!
//! [`ChunkReader::content_and_usage`] walks the chunk's JSON once, without allocating, and answers
//! only when it knows what `serde_json::from_slice::<Chunk>` (the meter's full reading,
//! `crate::Chunk`) would return: `Ok` with no `usage` (absent or `null`) and that many choices with
//! content. Everything else (the usage chunk, escapes in a key, a text it reads that serde_json
//! would fail to decode, a value of an unexpected type, a duplicate `choices` or `usage`, nesting
//! deeper than [`MAX_DEPTH`], invalid JSON, an array at the top) it leaves to that full reading, so
//! the meter's answer is the same either way. A text with escapes (a newline, a quote: common in
//! model output) is read: serde_json's decoding is checked, not done. The members it skips are
//! checked as serde_json checks the values it ignores (`IgnoredAny`): JSON syntax, no control
//! character in a string, valid escapes, no UTF-8 check. A chunk that differs from the last one
//! read only in its one text (the next token) is read from that text alone ([`ChunkReader`]'s
//! template).

/// Deepest nesting the walk follows; a deeper chunk is read by serde_json (whose limit, 128 for
/// the values it builds, is never reached below this).
const MAX_DEPTH: usize = 32;

fn ws(s: &[u8], mut i: usize) -> usize {
    while matches!(s.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// After `expect` at `i` (whitespace skipped first), the offset past it.
fn eat(s: &[u8], i: usize, expect: u8) -> Option<usize> {
    let i = ws(s, i);
    (s.get(i) == Some(&expect)).then_some(i + 1)
}

const LOW_BITS: u64 = 0x0101_0101_0101_0101;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// Whether any byte of `word` is `"`, `\` or a control character (below 0x20), or (with
/// `non_ascii`) 0x80 or above: the bytes a string walk stops at. Exact per byte.
fn stops(word: u64, non_ascii: bool) -> bool {
    let eq = |byte: u8| {
        let v = word ^ LOW_BITS.wrapping_mul(u64::from(byte));
        // The high bit of each zero byte of `v` (exact: no carry crosses bytes).
        !(((v & !HIGH_BITS).wrapping_add(!HIGH_BITS)) | v | !HIGH_BITS)
    };
    // The high bit of each byte below 0x20 (the low 7 bits plus 0x60 do not reach 0x80; bytes of
    // 0x80 and above are taken out by `!word`).
    let control = !((word & !HIGH_BITS).wrapping_add(LOW_BITS.wrapping_mul(0x60))) & !word & HIGH_BITS;
    let high = if non_ascii { word & HIGH_BITS } else { 0 };
    (eq(b'"') | eq(b'\\') | control | high) != 0
}

/// Whether `a` and `b` hold the same bytes, compared eight at a time. In the wasm filter a slice
/// comparison is the C library's `memcmp`, one byte at a time; this is several times faster there
/// (the template and prefix checks compare about 200 bytes per stream chunk), and as fast natively.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (mut wa, mut wb) = (a.chunks_exact(8), b.chunks_exact(8));
    let word = |w: &[u8]| u64::from_le_bytes(<[u8; 8]>::try_from(w).unwrap_or_default());
    if (&mut wa).zip(&mut wb).any(|(x, y)| word(x) != word(y)) {
        return false;
    }
    wa.remainder().iter().zip(wb.remainder()).all(|(x, y)| x == y)
}

/// Whether `data` begins with `prefix` ([`same_bytes`]).
fn begins_with(data: &[u8], prefix: &[u8]) -> bool {
    data.get(..prefix.len()).is_some_and(|head| same_bytes(head, prefix))
}

/// Whether `data` ends with `suffix` ([`same_bytes`]).
fn ends_with(data: &[u8], suffix: &[u8]) -> bool {
    data.len()
        .checked_sub(suffix.len())
        .and_then(|at| data.get(at..))
        .is_some_and(|tail| same_bytes(tail, suffix))
}

/// `j` moved past every 8-byte word of `s` from `j` on that holds no byte [`stops`] at.
fn skip_plain(s: &[u8], mut j: usize, non_ascii: bool) -> usize {
    while let Some(Ok(bytes)) = s.get(j..j + 8).map(<[u8; 8]>::try_from) {
        if stops(u64::from_le_bytes(bytes), non_ascii) {
            break;
        }
        j += 8;
    }
    j
}

/// The string at `i` (a `"`), as serde_json skips an ignored one: the offset past its closing
/// quote. `None`: a control character, an invalid escape, or no end.
fn skip_string(s: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    loop {
        j = skip_plain(s, j, false);
        let b = *s.get(j)?;
        match b {
            b'"' => return Some(j + 1),
            b'\\' => match s.get(j + 1)? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => j += 2,
                b'u' => {
                    let hex = s.get(j + 2..j + 6)?;
                    if !hex.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                    j += 6;
                }
                _ => return None,
            },
            0..=0x1f => return None,
            _ => j += 1,
        }
    }
}

/// Four hex digits at `i` as a UTF-16 code unit.
fn hex4(s: &[u8], i: usize) -> Option<u16> {
    let digits = std::str::from_utf8(s.get(i..i + 4)?).ok()?;
    if !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u16::from_str_radix(digits, 16).ok()
}

/// The string at `i` read as serde_json decodes it into a `Cow<str>`: whether it is non-empty,
/// and the offset past it. `None` where serde_json fails: a control character, an invalid escape,
/// a surrogate escape that is not a leading one followed at once by a trailing one, invalid
/// UTF-8. Every escape decodes to at least one character, so the string is empty only when no
/// byte lies between its quotes.
fn read_text(s: &[u8], i: usize) -> Option<(bool, usize)> {
    let start = i + 1;
    let mut j = start;
    let mut ascii = true;
    loop {
        if ascii {
            j = skip_plain(s, j, true);
        }
        match *s.get(j)? {
            b'"' => break,
            b'\\' => {
                j += match *s.get(j + 1)? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => 2,
                    b'u' => match hex4(s, j + 2)? {
                        0xD800..=0xDBFF => {
                            // A leading surrogate: a trailing one must follow (serde_json's
                            // `parse_unicode_escape` when it decodes).
                            if s.get(j + 6..j + 8) != Some(b"\\u") {
                                return None;
                            }
                            if !(0xDC00..=0xDFFF).contains(&hex4(s, j + 8)?) {
                                return None;
                            }
                            12
                        }
                        0xDC00..=0xDFFF => return None,
                        _ => 6,
                    },
                    _ => return None,
                };
            }
            0..=0x1f => return None,
            b => {
                ascii &= b < 0x80;
                j += 1;
            }
        }
    }
    if !ascii {
        std::str::from_utf8(s.get(start..j)?).ok()?;
    }
    Some((j > start, j + 1))
}

/// A key at `i` (after whitespace) as a field name: its raw bytes, printable ASCII without escapes
/// (what serde_json matches a field name against unchanged), and the offset past its colon.
fn key(s: &[u8], i: usize) -> Option<(&[u8], usize)> {
    let i = ws(s, i);
    if s.get(i) != Some(&b'"') {
        return None;
    }
    // Keys are short: a byte at a time, stopping at anything but printable ASCII.
    let mut j = i + 1;
    loop {
        match *s.get(j)? {
            b'"' => break,
            b'\\' => return None,
            0x20..=0x7e => j += 1,
            _ => return None,
        }
    }
    Some((s.get(i + 1..j)?, eat(s, j + 1, b':')?))
}

/// The number at `i`, as serde_json's `ignore_integer` / `ignore_decimal` / `ignore_exponent`.
fn skip_number(s: &[u8], mut i: usize) -> Option<usize> {
    let digits = |s: &[u8], mut i: usize| {
        while s.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        i
    };
    if s.get(i) == Some(&b'-') {
        i += 1;
    }
    match s.get(i)? {
        b'0' => {
            i += 1;
            if s.get(i).is_some_and(u8::is_ascii_digit) {
                return None;
            }
        }
        b'1'..=b'9' => i = digits(s, i + 1),
        _ => return None,
    }
    if s.get(i) == Some(&b'.') {
        let end = digits(s, i + 1);
        if end == i + 1 {
            return None;
        }
        i = end;
    }
    if matches!(s.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(s.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let end = digits(s, i);
        if end == i {
            return None;
        }
        i = end;
    }
    Some(i)
}

/// The value at `i` (after whitespace), checked as serde_json ignores it: the offset past it.
fn skip_value(s: &[u8], i: usize, depth: usize) -> Option<usize> {
    let i = ws(s, i);
    match *s.get(i)? {
        b'"' => skip_string(s, i),
        b'n' => s.get(i..i + 4).filter(|w| *w == b"null").map(|_| i + 4),
        b't' => s.get(i..i + 4).filter(|w| *w == b"true").map(|_| i + 4),
        b'f' => s.get(i..i + 5).filter(|w| *w == b"false").map(|_| i + 5),
        b'-' | b'0'..=b'9' => skip_number(s, i),
        open @ (b'[' | b'{') => {
            if depth >= MAX_DEPTH {
                return None;
            }
            let close = if open == b'[' { b']' } else { b'}' };
            let mut j = ws(s, i + 1);
            if s.get(j) == Some(&close) {
                return Some(j + 1);
            }
            loop {
                if open == b'{' {
                    if s.get(j) != Some(&b'"') {
                        return None;
                    }
                    j = eat(s, skip_string(s, j)?, b':')?;
                }
                j = ws(s, skip_value(s, j, depth + 1)?);
                match *s.get(j)? {
                    b',' => j = ws(s, j + 1),
                    b if b == close => return Some(j + 1),
                    _ => return None,
                }
            }
        }
        _ => None,
    }
}

/// The members of the object at `i` (after whitespace): `on_member(key, value offset)` reads or
/// skips each value and returns the offset past it. The offset past the object.
fn object(s: &[u8], i: usize, mut on_member: impl FnMut(&[u8], usize) -> Option<usize>) -> Option<usize> {
    let mut j = eat(s, i, b'{')?;
    if s.get(ws(s, j)) == Some(&b'}') {
        return Some(ws(s, j) + 1);
    }
    loop {
        let (name, value) = key(s, j)?;
        j = ws(s, on_member(name, value)?);
        match *s.get(j)? {
            b',' => j += 1,
            b'}' => return Some(j + 1),
            _ => return None,
        }
    }
}

/// The text strings a walk read (not the `null` texts): how many, and the span of the last (its
/// opening quote, and one past its closing quote).
#[derive(Debug, Default, Clone, Copy)]
struct Texts {
    count: u32,
    last: (usize, usize),
}

/// An `Option<Cow<str>>` member at `i`: whether it is a non-empty string (`null`: no), and the
/// offset past it. A string is recorded in `texts`.
fn optional_text(s: &[u8], i: usize, texts: &mut Texts) -> Option<(bool, usize)> {
    let i = ws(s, i);
    match s.get(i)? {
        b'n' => s.get(i..i + 4).filter(|w| *w == b"null").map(|_| (false, i + 4)),
        b'"' => {
            let (nonempty, end) = read_text(s, i)?;
            texts.count = texts.count.saturating_add(1);
            texts.last = (i, end);
            Some((nonempty, end))
        }
        _ => None,
    }
}

/// Reads one member of `crate::Choice`'s or `crate::Delta`'s text fields at most once.
fn text_once(seen: &mut bool, any: &mut bool, s: &[u8], value: usize, texts: &mut Texts) -> Option<usize> {
    if std::mem::replace(seen, true) {
        return None;
    }
    let (nonempty, end) = optional_text(s, value, texts)?;
    *any |= nonempty;
    Some(end)
}

/// A choice (`crate::Choice`) at `i`: whether it has content, and the offset past it.
fn choice(s: &[u8], i: usize, texts: &mut Texts) -> Option<(bool, usize)> {
    let (mut seen_delta, mut seen_text, mut any) = (false, false, false);
    let end = object(s, i, |name, value| match name {
        b"delta" => {
            if std::mem::replace(&mut seen_delta, true) {
                return None;
            }
            let v = ws(s, value);
            if s.get(v..v + 4) == Some(b"null") {
                return Some(v + 4);
            }
            let (mut seen_content, mut seen_reasoning) = (false, false);
            object(s, v, |name, value| match name {
                b"content" => text_once(&mut seen_content, &mut any, s, value, texts),
                b"reasoning_content" => text_once(&mut seen_reasoning, &mut any, s, value, texts),
                _ => skip_value(s, value, 4),
            })
        }
        b"text" => text_once(&mut seen_text, &mut any, s, value, texts),
        _ => skip_value(s, value, 3),
    })?;
    Some((any, end))
}

/// Longest stream prefix [`ChunkReader`] keeps, and longest head and tail of its template.
const MAX_PREFIX_BYTES: usize = 512;

/// A chunk walked with exactly one text string in it, kept as a template for the next: a chunk
/// with the same bytes before that string's opening quote (`head`) and from its closing quote on
/// (`tail`), and a valid text between them, walks as it did (the walk's state after a string does
/// not depend on what the string holds), but for whether that one choice has content and for the
/// offsets after the string, shifted by the length the string gained or lost.
#[derive(Debug)]
struct Template {
    /// The chunk up to and including the string's opening quote.
    head: Vec<u8>,
    /// The chunk from the string's closing quote on.
    tail: Vec<u8>,
    /// The chunk's length.
    len: usize,
    /// The offset one past its string.
    string_end: usize,
    /// Its usage member, as the walk found it.
    usage: Option<ChunkUsage>,
}

impl Template {
    /// A chunk's reading from the template, where the chunk fits it.
    fn read(&self, data: &[u8]) -> Option<(u64, Option<ChunkUsage>)> {
        let tail_at = data.len().checked_sub(self.tail.len())?;
        if tail_at < self.head.len() || !begins_with(data, &self.head) || !ends_with(data, &self.tail) {
            return None;
        }
        // The string must end at the tail's closing quote, as the walk would read it.
        let (nonempty, end) = read_text(data, self.head.len().checked_sub(1)?)?;
        if end != tail_at + 1 {
            return None;
        }
        let shift =
            |at: usize| if at >= self.string_end { (at + data.len()).saturating_sub(self.len) } else { at };
        let usage = match self.usage {
            Some(ChunkUsage::Null { start, value_end, prev_end, next_start }) => Some(ChunkUsage::Null {
                start: shift(start),
                value_end: shift(value_end),
                prev_end: prev_end.map(shift),
                next_start: next_start.map(shift),
            }),
            other => other,
        };
        Some((u64::from(nonempty), usage))
    }
}

/// Reads the chunks of one stream with [`ChunkReader::content_and_usage`]. The chunks of a vLLM
/// stream begin with the same bytes (`{"id":"chatcmpl-…","object":"chat.completion.chunk",
/// "created":…,"model":"…",` and the `"choices"` key): the reader keeps that prefix of the last
/// chunk it walked whole, and a chunk that begins with it is walked from there on. Exact: the walk
/// up to the `"choices"` key reads no byte past it, and carries nothing past it but where it is (no
/// `choices` or `usage` seen yet, no content counted).
///
/// Then most content chunks differ from the one before only in their one text string (the
/// token): the reader keeps the last chunk it read with exactly one as a [`Template`], and a chunk
/// that fits it is read by checking that string alone.
#[derive(Debug, Default)]
pub(crate) struct ChunkReader {
    /// The bytes before the `"choices"` key of the last chunk walked whole (empty: none).
    prefix: Vec<u8>,
    /// The last chunk read with exactly one text string.
    template: Option<Template>,
}

impl ChunkReader {
    /// The choices with content of a chunk that carries no usage, when serde_json would read it
    /// so; `None` leaves the chunk to serde_json (see the module's documentation).
    /// Also where the chunk's top-level `usage` member is (`None`: a `null` one whose member
    /// before it lies in the kept prefix, not walked).
    pub(crate) fn content_and_usage(&mut self, data: &[u8]) -> Option<(u64, Option<ChunkUsage>)> {
        if let Some(read) = self.template.as_ref().and_then(|t| t.read(data)) {
            return Some(read);
        }
        let mut texts = Texts::default();
        let read = if !self.prefix.is_empty() && begins_with(data, &self.prefix) {
            members(data, self.prefix.len(), true, &mut None, &mut texts)
        } else {
            let mut choices_at = None;
            let j = eat(data, 0, b'{')?;
            let read = if s_at(data, j) == Some(b'}') {
                (ws(data, ws(data, j) + 1) == data.len()).then_some((0, Some(ChunkUsage::Absent)))
            } else {
                members(data, j, false, &mut choices_at, &mut texts)
            };
            self.prefix.clear();
            if let Some(at) = choices_at.filter(|at| *at <= MAX_PREFIX_BYTES) {
                self.prefix.extend_from_slice(data.get(..at).unwrap_or_default());
            }
            read
        };
        if let (Some((_, usage)), 1) = (read, texts.count) {
            self.keep_template(data, texts.last, usage);
        }
        read
    }

    /// Keeps `data`, read with one text string at `(open, end)`, as the template.
    fn keep_template(&mut self, data: &[u8], (open, end): (usize, usize), usage: Option<ChunkUsage>) {
        let (Some(head), Some(tail)) = (data.get(..open + 1), end.checked_sub(1).and_then(|c| data.get(c..)))
        else {
            return;
        };
        if head.len() > MAX_PREFIX_BYTES || tail.len() > MAX_PREFIX_BYTES {
            self.template = None;
            return;
        }
        let template = self.template.get_or_insert_with(|| Template {
            head: Vec::new(),
            tail: Vec::new(),
            len: 0,
            string_end: 0,
            usage: None,
        });
        template.head.clear();
        template.head.extend_from_slice(head);
        template.tail.clear();
        template.tail.extend_from_slice(tail);
        template.len = data.len();
        template.string_end = end;
        template.usage = usage;
    }
}

/// The top-level `usage` member of a content chunk the walk read (a chunk with usage numbers is
/// never one): what a caller that rewrites the chunk needs to remove a `"usage":null` member
/// without walking the chunk again (the wasm filter's usage stripper, which removes it as
/// `gateway_filter::json_scan::ObjectScan::removal_range` does). Offsets are into the event's
/// data (the `data:` line's value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChunkUsage {
    /// No top-level `usage` member.
    Absent,
    /// One top-level `"usage": null` member.
    Null {
        /// Offset of the member key's opening quote.
        start: usize,
        /// Offset one past `null`.
        value_end: usize,
        /// Offset one past the value of the member before it, if any.
        prev_end: Option<usize>,
        /// Offset of the next member key's opening quote, if any.
        next_start: Option<usize>,
    },
}

/// The choices with content of a chunk without usage (see [`ChunkReader::content_and_usage`]), and
/// its [`ChunkUsage`], from `j`, the start of a member of the top-level object (after its `{` or a
/// `,`) before which no `choices` or `usage` member came; `after_prefix`: members before `j` were
/// not walked (the usage's is then `None` where the member before it is one of them).
/// `choices_at`, when given, is set to where the `"choices"` member starts if no `usage` member
/// came before it.
fn members(
    data: &[u8],
    mut j: usize,
    after_prefix: bool,
    choices_at: &mut Option<usize>,
    texts: &mut Texts,
) -> Option<(u64, Option<ChunkUsage>)> {
    let (mut seen_choices, mut seen_usage, mut with_content) = (false, false, 0u64);
    // The `null` usage member's start, value end and the end of the member before it; the start
    // of the member after it.
    let mut usage: Option<(usize, usize, Option<usize>)> = None;
    let mut next_start: Option<usize> = None;
    let mut prev_end: Option<usize> = None;
    loop {
        let member_at = j;
        if usage.is_some() && next_start.is_none() {
            next_start = Some(ws(data, j));
        }
        let (name, value) = key(data, j)?;
        let end = match name {
            b"choices" => {
                if std::mem::replace(&mut seen_choices, true) {
                    return None;
                }
                if !seen_usage {
                    *choices_at = Some(member_at);
                }
                let mut j = eat(data, value, b'[')?;
                if s_at(data, j) == Some(b']') {
                    ws(data, j) + 1
                } else {
                    loop {
                        let (any, end) = choice(data, j, texts)?;
                        with_content = with_content.saturating_add(u64::from(any));
                        j = ws(data, end);
                        match *data.get(j)? {
                            b',' => j += 1,
                            b']' => break j + 1,
                            _ => return None,
                        }
                    }
                }
            }
            b"usage" => {
                if std::mem::replace(&mut seen_usage, true) {
                    return None;
                }
                let v = ws(data, value);
                // A usage object is the usage chunk's: serde_json reads it.
                if data.get(v..v + 4) != Some(b"null") {
                    return None;
                }
                usage = Some((ws(data, member_at), v + 4, prev_end));
                v + 4
            }
            _ => skip_value(data, value, 1)?,
        };
        prev_end = Some(end);
        j = ws(data, end);
        match *data.get(j)? {
            b',' => j += 1,
            b'}' => {
                if ws(data, j + 1) != data.len() {
                    return None;
                }
                let usage = match usage {
                    None => Some(ChunkUsage::Absent),
                    // The member before it was in the prefix, not walked.
                    Some((_, _, None)) if after_prefix && next_start.is_none() => None,
                    Some((start, value_end, prev_end)) => {
                        Some(ChunkUsage::Null { start, value_end, prev_end, next_start })
                    }
                };
                return Some((with_content, usage));
            }
            _ => return None,
        }
    }
}

/// The choices with content of one chunk read alone (tests).
#[cfg(test)]
fn content_choices(data: &[u8]) -> Option<u64> {
    ChunkReader::default().content_and_usage(data).map(|(n, _)| n)
}

/// The byte at `i` after whitespace.
fn s_at(s: &[u8], i: usize) -> Option<u8> {
    s.get(ws(s, i)).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_content_chunks() {
        let c = br#"{"id":"c","object":"chat.completion.chunk","created":1,"choices":[{"index":0,"delta":{"content":"hi"},"logprobs":null,"finish_reason":null}],"usage":null}"#;
        assert_eq!(content_choices(c), Some(1));
        let role = br#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        assert_eq!(content_choices(role), Some(0));
        let text = br#" { "choices" : [ {"text":"a"}, {"text":""}, {"delta":null,"text":null}, {"delta":{"reasoning_content":"r"}} ] } "#;
        assert_eq!(content_choices(text), Some(2));
        assert_eq!(content_choices(b"{}"), Some(0));
        // Escapes in a text are read (checked as serde_json decodes them).
        let escaped =
            br#"{"choices":[{"delta":{"content":"a\"b\n"}},{"text":"\ud83d\ude00"},{"text":"\u0000"}]}"#;
        assert_eq!(content_choices(escaped), Some(3));
        let long = "word \\u00e9 caf\\u00e9 ".repeat(9);
        let c = format!(r#"{{"id":"{long}","choices":[{{"text":"{}"}}]}}"#, "caf\u{e9} ".repeat(9));
        assert_eq!(content_choices(c.as_bytes()), Some(1));
        let bad_utf8 = [&br#"{"choices":[{"text":"abcdefghij"#[..], &[0xff], br#"klmnop"}]}"#].concat();
        assert_eq!(content_choices(&bad_utf8), None);
    }

    #[test]
    fn word_comparisons_agree_with_slice_comparisons() {
        let base: Vec<u8> = (0..40u8).collect();
        for len in 0..=base.len() {
            let a = base.get(..len).unwrap();
            assert!(same_bytes(a, a));
            for at in 0..len {
                let mut b = a.to_vec();
                b[at] ^= 0x80;
                assert!(!same_bytes(a, &b), "len {len}, byte {at}");
                assert_eq!(begins_with(&base, &b), base.starts_with(&b));
                assert_eq!(ends_with(&base, &b), base.ends_with(&b));
            }
            assert!(!same_bytes(a, &base[..len.saturating_sub(1)]) || len == 0);
            assert!(begins_with(&base, a) && ends_with(&base, &base[base.len() - len..]));
        }
        assert!(!begins_with(b"ab", b"abc") && !ends_with(b"bc", b"abc"));
    }

    #[test]
    fn stops_at_exactly_the_bytes_a_string_walk_handles() {
        for b in 0..=255u8 {
            for at in 0..8 {
                let mut word = *b"abcdefgh";
                word[at] = b;
                let w = u64::from_le_bytes(word);
                let special = b == b'"' || b == b'\\' || b < 0x20;
                assert_eq!(stops(w, false), special, "byte {b:#x} at {at}");
                assert_eq!(stops(w, true), special || b >= 0x80, "byte {b:#x} at {at}");
            }
        }
    }

    #[test]
    fn leaves_the_rest_to_serde() {
        for c in [
            &br#"{"choices":[],"usage":{"prompt_tokens":1}}"#[..],
            br#"{"choices":[{"delta":{"content":"\ud800"}}]}"#,
            br#"{"choices":[{"delta":{"content":"\udc00"}}]}"#,
            br#"{"choices":[{"delta":{"content":"\ud800\u0041"}}]}"#,
            br#"{"choices":[{"delta":{"content":"a\qb"}}]}"#,
            br#"{"choices":[{"text":"\u00g0"}]}"#,
            br#"{"choices":null}"#,
            br#"{"choices":[],"choices":[]}"#,
            br#"{"choices":[{"delta":{"content":1}}]}"#,
            br#"{"ch\u006fices":[]}"#,
            br#"{"a":01}"#,
            br#"{"a":[1,]}"#,
            br#"{"a":"\x"}"#,
            br#"{} x"#,
            br#"[[]]"#,
            br#"{"choices":[{"delta":{"content":"a"}}]"#,
        ] {
            assert_eq!(content_choices(c), None, "{}", String::from_utf8_lossy(c));
        }
    }
}

/// [`content_choices`] against the meter's full reading (serde_json into `crate::Chunk`): on
/// generated chunks and on every kind of damage to them, an answer is always serde_json's.
#[cfg(test)]
mod props {
    use super::content_choices;
    use crate::Chunk;
    use proptest::prelude::*;
    use serde_json::{json, Value};

    /// What serde_json reads: `Some(choices with content)` for a chunk without usage.
    fn serde_reading(data: &[u8]) -> Option<Option<u64>> {
        serde_json::from_slice::<Chunk>(data)
            .ok()
            .map(|c| c.usage.is_none().then_some(c.choices.with_content))
    }

    fn text() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            Just(json!("")),
            "\\PC{0,12}".prop_map(Value::from),
            Just(json!("a\"b\\c\n\u{e9}\u{1F642}")),
            (0..RAW_ESCAPES.len()).prop_map(|k| json!(format!("@E{k}@"))),
            Just(json!(7)),
        ]
    }

    /// Escapes serde_json never writes, put in place of `@E<k>@` after serialization: a surrogate
    /// pair, lone and unpaired surrogates, `\u` of a BMP character, the short escapes, and a bare
    /// quote.
    const RAW_ESCAPES: [&str; 9] = [
        r"\ud83d\ude00",
        r"\ud800",
        r"\udc00x",
        r"\u00e9x",
        r"\ud800\u0041",
        r"\ud800\ud800",
        r"\ud800ABdc00",
        r"\n\t\/\b\f\r",
        // Not an escape: a quote that ends the string early (the chunk is not JSON).
        r#"q"q"#,
    ];

    fn with_raw_escapes(json: Vec<u8>) -> Vec<u8> {
        let mut text = String::from_utf8(json).unwrap_or_default();
        for (k, raw) in RAW_ESCAPES.iter().enumerate() {
            text = text.replace(&format!("@E{k}@"), raw);
        }
        text.into_bytes()
    }

    fn choice() -> impl Strategy<Value = Value> {
        (text(), text(), text(), any::<bool>(), any::<bool>()).prop_map(
            |(content, reasoning, t, null_delta, extra)| {
                let mut c = json!({"index": 0, "logprobs": null, "finish_reason": null});
                if null_delta {
                    c["delta"] = Value::Null;
                } else {
                    c["delta"] =
                        json!({"role": "assistant", "content": content, "reasoning_content": reasoning});
                }
                if extra {
                    c["text"] = t;
                    c["nested"] = json!({"a": [1, -2.5e3, true, false, null, {"b": "\u{0}x"}]});
                }
                c
            },
        )
    }

    fn chunk() -> impl Strategy<Value = Vec<u8>> {
        (prop::collection::vec(choice(), 0..4), 0u8..4, any::<bool>()).prop_map(|(choices, usage, pretty)| {
            let mut c = json!({"id": "chatcmpl-0123456789", "object": "chat.completion.chunk",
                "created": 1_700_000_000u64, "model": "sim-model", "choices": choices});
            match usage {
                0 => {}
                1 => c["usage"] = Value::Null,
                2 => c["usage"] = json!({"prompt_tokens": 3, "completion_tokens": 4}),
                _ => c["usage"] = json!("x"),
            }
            with_raw_escapes(if pretty {
                serde_json::to_vec_pretty(&c).unwrap_or_default()
            } else {
                serde_json::to_vec(&c).unwrap_or_default()
            })
        })
    }

    proptest! {
        // PROPTEST_CASES sets the cases (default 256; `make fuzz`: many more); no failure file.
        #![proptest_config(ProptestConfig {
            failure_persistence: Some(Box::new(proptest::test_runner::FileFailurePersistence::Off)),
            ..ProptestConfig::default()
        })]

        #[test]
        fn valid_chunks_read_as_serde_reads_them(data in chunk()) {
            let fast = content_choices(&data);
            if let Some(n) = fast {
                prop_assert_eq!(serde_reading(&data), Some(Some(n)));
            }
        }

        #[test]
        fn damaged_chunks_read_as_serde_reads_them(
            data in chunk(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..4),
        ) {
            let mut data = data;
            for (at, byte, kind) in edits {
                if data.is_empty() {
                    break;
                }
                let i = at.index(data.len());
                // Mostly JSON's own bytes, so that the damage often still parses.
                const BYTES: &[u8] = b"{}[]\",:\\ 0-e.tnu\x01\xff";
                let byte = BYTES[usize::from(byte) % BYTES.len()];
                match kind {
                    0 => data[i] = byte,
                    1 => data.insert(i, byte),
                    _ => {
                        data.remove(i);
                    }
                }
            }
            if let Some(n) = content_choices(&data) {
                prop_assert_eq!(serde_reading(&data), Some(Some(n)), "{}", String::from_utf8_lossy(&data));
            }
        }

        /// A stream's reader (which walks a chunk from the prefix of the last one) reads every
        /// chunk as a reader of that chunk alone, on streams of chunks that share their prefix,
        /// some damaged before or after it.
        #[test]
        fn a_stream_reads_each_chunk_as_alone(
            chunks in prop::collection::vec(
                (chunk(), any::<prop::sample::Index>(), any::<u8>(), any::<bool>()), 1..8),
        ) {
            read_as_alone(chunks)?;
        }

        /// The same on streams whose chunks differ in one text only, as a model's tokens do (the
        /// reader's template), some damaged anywhere.
        #[test]
        fn a_stream_of_tokens_reads_each_chunk_as_alone(
            chunks in one_skeleton().prop_flat_map(|chunks| {
                let n = chunks.len();
                (Just(chunks), prop::collection::vec(
                    (any::<prop::sample::Index>(), any::<u8>(), prop::bool::weighted(0.2)), n))
            }),
        ) {
            let (chunks, damage) = chunks;
            read_as_alone(chunks.into_iter().zip(damage).map(|(c, (at, byte, d))| (c, at, byte, d)).collect())?;
        }
    }

    /// Chunks of one skeleton (choices, usage, layout) whose first choice's content differs.
    fn one_skeleton() -> impl Strategy<Value = Vec<Vec<u8>>> {
        (prop::collection::vec(choice(), 1..3), 0u8..3, any::<bool>(), prop::collection::vec(text(), 1..8))
            .prop_map(|(choices, usage, pretty, texts)| {
                texts
                    .into_iter()
                    .map(|t| {
                        let mut choices = choices.clone();
                        if let Some(first) = choices.first_mut() {
                            first["delta"] = json!({"content": t});
                        }
                        let mut c = json!({"id": "chatcmpl-0123456789", "object": "chat.completion.chunk",
                            "created": 1_700_000_000u64, "model": "sim-model", "choices": choices});
                        match usage {
                            0 => {}
                            1 => c["usage"] = Value::Null,
                            _ => c["usage"] = json!({"prompt_tokens": 3}),
                        }
                        with_raw_escapes(if pretty {
                            serde_json::to_vec_pretty(&c).unwrap_or_default()
                        } else {
                            serde_json::to_vec(&c).unwrap_or_default()
                        })
                    })
                    .collect()
            })
    }

    /// Feeds `chunks` (each damaged at one byte where asked) to one reader: each reading is the
    /// chunk's reading alone, and serde_json's.
    fn read_as_alone(chunks: Vec<(Vec<u8>, prop::sample::Index, u8, bool)>) -> Result<(), TestCaseError> {
        let mut reader = super::ChunkReader::default();
        for (data, at, byte, damage) in chunks {
            let mut data = data;
            if damage && !data.is_empty() {
                const BYTES: &[u8] = b"{}[]\",: 0n\\";
                let i = at.index(data.len());
                data[i] = BYTES[usize::from(byte) % BYTES.len()];
            }
            let kept = reader.content_and_usage(&data);
            let alone = super::ChunkReader::default().content_and_usage(&data);
            prop_assert_eq!(
                kept.map(|(n, _)| n),
                content_choices(&data),
                "{}",
                String::from_utf8_lossy(&data)
            );
            // Where the usage member is, if the prefix lets the reader say, is as read alone.
            if let (Some((_, Some(u))), Some((_, v))) = (kept, alone) {
                prop_assert_eq!(Some(u), v, "{}", String::from_utf8_lossy(&data));
            }
        }
        Ok(())
    }
}
