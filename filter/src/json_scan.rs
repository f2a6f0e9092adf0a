//! A byte-level scanner for the top-level members of a JSON object, used for surgical edits
//! (replace one value, insert or remove one member) that keep every other byte of the document
//! unchanged: key order, number formatting and string escapes are preserved.
//!
//! The scanner assumes the input has already been accepted by `serde_json` (it validates only
//! what it needs) and returns `None` instead of panicking on anything unexpected.

use std::borrow::Cow;

/// A JSON value checked as `serde_json` checks one it builds into a `serde_json::Value` (syntax,
/// escapes, UTF-8, number range, nesting depth: the same errors), without building it: no
/// allocation per string, number, array or member. What a large body's members the filter does
/// not read get (`pipeline::on_large_body`), so that a body of many small members costs no more
/// than its bytes, and is refused exactly where the full parse refuses it.
#[derive(Debug, Clone, Copy)]
pub struct CheckedValue;

impl<'de> serde::Deserialize<'de> for CheckedValue {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(CheckedVisitor)
    }
}

/// The visitor of [`CheckedValue`]: accepts every value, visits every element and member.
struct CheckedVisitor;

impl<'de> serde::de::Visitor<'de> for CheckedVisitor {
    type Value = CheckedValue;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<CheckedValue, E> {
        Ok(CheckedValue)
    }

    fn visit_i64<E>(self, _: i64) -> Result<CheckedValue, E> {
        Ok(CheckedValue)
    }

    fn visit_u64<E>(self, _: u64) -> Result<CheckedValue, E> {
        Ok(CheckedValue)
    }

    fn visit_f64<E>(self, _: f64) -> Result<CheckedValue, E> {
        Ok(CheckedValue)
    }

    fn visit_str<E>(self, _: &str) -> Result<CheckedValue, E> {
        Ok(CheckedValue)
    }

    fn visit_unit<E>(self) -> Result<CheckedValue, E> {
        Ok(CheckedValue)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<CheckedValue, A::Error> {
        while seq.next_element::<CheckedValue>()?.is_some() {}
        Ok(CheckedValue)
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<CheckedValue, A::Error> {
        while map.next_entry::<CheckedValue, CheckedValue>()?.is_some() {}
        Ok(CheckedValue)
    }
}

/// One `"key": value` member of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The key, with JSON escapes decoded.
    pub key: String,
    /// Byte offset of the key's opening quote.
    pub start: usize,
    /// Byte offset of the first byte of the value.
    pub value_start: usize,
    /// Byte offset one past the last byte of the value.
    pub value_end: usize,
}

/// The top-level members of an object and the offsets of its braces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectScan {
    /// Offset of `{`.
    pub open: usize,
    /// Offset of the matching `}`.
    pub close: usize,
    /// Members in document order (duplicates included).
    pub members: Vec<Member>,
}

impl ObjectScan {
    /// The last member named `key` (the one `serde_json` and Python's `json` keep).
    pub fn get(&self, key: &str) -> Option<&Member> {
        self.members.iter().rev().find(|m| m.key == key)
    }

    /// The first key that appears more than once, if any: the key of the first member (in
    /// document order) whose decoded key an earlier member already has.
    ///
    /// Linear in the number of members: one hash-set insertion per member (std's `HashSet`,
    /// SipHash with per-process random keys, so a client cannot choose colliding keys). This runs
    /// on Envoy's worker thread before any limit applies; a 4 MiB body holds ~400,000 short
    /// members, which a comparison of every pair (~8 * 10^10 comparisons) would stall.
    pub fn first_duplicate(&self) -> Option<&str> {
        let mut seen = std::collections::HashSet::with_capacity(self.members.len());
        self.members.iter().find_map(|m| (!seen.insert(CountedKey(&m.key))).then_some(m.key.as_str()))
    }

    /// The byte range to delete to remove member number `index` together with one separating
    /// comma: from its key to the start of the next member's key, or, for the last member, from
    /// the end of the previous member's value to the end of this value.
    pub fn removal_range(&self, index: usize) -> Option<(usize, usize)> {
        let m = self.members.get(index)?;
        if let Some(next) = self.members.get(index + 1) {
            Some((m.start, next.start))
        } else if index > 0 {
            let prev = self.members.get(index - 1)?;
            Some((prev.value_end, m.value_end))
        } else {
            Some((m.start, m.value_end))
        }
    }
}

/// A decoded key in [`ObjectScan::first_duplicate`]'s set. Hashes as the `str`; each equality
/// test is counted in tests ([`key_comparisons`]), to bound the work of the duplicate check.
#[derive(Hash)]
struct CountedKey<'a>(&'a str);

impl PartialEq for CountedKey<'_> {
    fn eq(&self, other: &Self) -> bool {
        #[cfg(test)]
        KEY_COMPARISONS.with(|c| c.set(c.get() + 1));
        self.0 == other.0
    }
}

impl Eq for CountedKey<'_> {}

#[cfg(test)]
thread_local! {
    static KEY_COMPARISONS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Key equality tests made by [`ObjectScan::first_duplicate`] on this thread so far (tests only).
#[cfg(test)]
fn key_comparisons() -> u64 {
    KEY_COMPARISONS.with(std::cell::Cell::get)
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

fn skip_ws(s: &[u8], mut i: usize) -> usize {
    while s.get(i).is_some_and(|b| is_ws(*b)) {
        i += 1;
    }
    i
}

const LOW_BITS: u64 = 0x0101_0101_0101_0101;
const HIGH_BITS: u64 = 0x8080_8080_8080_8080;

/// The high bit of every byte of `word` that equals `byte`, exactly (no borrow crosses bytes).
fn byte_mask(word: u64, byte: u8) -> u64 {
    let v = word ^ LOW_BITS.wrapping_mul(u64::from(byte));
    !(((v & !HIGH_BITS).wrapping_add(!HIGH_BITS)) | v | !HIGH_BITS)
}

/// The 8 high bits of a [`byte_mask`] packed into bits 0..8 (byte `k` → bit `k`).
fn pack_high_bits(mask: u64) -> u64 {
    (mask >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56
}

/// Bit `k` set where `block[k]` is `"`, and where it is `\`.
fn quotes_and_backslashes(block: &[u8; 64]) -> (u64, u64) {
    let (mut quotes, mut backslashes) = (0u64, 0u64);
    for (k, chunk) in block.chunks_exact(8).enumerate() {
        let Ok(bytes) = <[u8; 8]>::try_from(chunk) else { continue };
        let word = u64::from_le_bytes(bytes);
        quotes |= pack_high_bits(byte_mask(word, b'"')) << (8 * k);
        backslashes |= pack_high_bits(byte_mask(word, b'\\')) << (8 * k);
    }
    (quotes, backslashes)
}

/// The bytes of a 64-byte block that a backslash escapes (simdjson's branch-free
/// `find_escaped`): in a run of backslashes every second one escapes the byte after it.
/// `prev_escaped` carries whether the block's first byte is escaped, in and out.
fn escaped_bytes(backslashes: u64, prev_escaped: &mut u64) -> u64 {
    const EVEN_BITS: u64 = 0x5555_5555_5555_5555;
    let backslashes = backslashes & !*prev_escaped;
    let follows_escape = backslashes << 1 | *prev_escaped;
    let odd_sequence_starts = backslashes & !EVEN_BITS & !follows_escape;
    let (sequences_starting_on_even_bits, overflow) = odd_sequence_starts.overflowing_add(backslashes);
    *prev_escaped = u64::from(overflow);
    let invert_mask = sequences_starting_on_even_bits << 1;
    (EVEN_BITS ^ invert_mask) & follows_escape
}

/// Offset one past the closing quote of the string starting at `i` (which must be `"`). The
/// string is searched 64 bytes at a time for its first unescaped `"`, without a branch per
/// escape: request bodies are mostly the text inside strings, often dense with `\uXXXX` escapes
/// (Python's `json`, and so the OpenAI SDK, sends non-ASCII text that way), and this scan runs on
/// Envoy's worker threads.
fn skip_string(s: &[u8], i: usize) -> Option<usize> {
    if s.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    // Short strings (keys, roles, ids) end within a word or two: a word at a time first, until
    // the end or a backslash.
    for _ in 0..2 {
        let Some(Ok(bytes)) = s.get(j..j + 8).map(<[u8; 8]>::try_from) else { break };
        let word = u64::from_le_bytes(bytes);
        let (quotes, backslashes) = (byte_mask(word, b'"'), byte_mask(word, b'\\'));
        if quotes != 0 && (backslashes == 0 || quotes.trailing_zeros() < backslashes.trailing_zeros()) {
            return Some(j + (quotes.trailing_zeros() / 8) as usize + 1);
        }
        if backslashes != 0 {
            break;
        }
        j += 8;
    }
    let mut prev_escaped = 0u64;
    while let Some(chunk) = s.get(j..j + 64) {
        let Ok(block) = <&[u8; 64]>::try_from(chunk) else { break };
        let (quotes, backslashes) = quotes_and_backslashes(block);
        let closing = quotes & !escaped_bytes(backslashes, &mut prev_escaped);
        if closing != 0 {
            return Some(j + closing.trailing_zeros() as usize + 1);
        }
        j += 64;
    }
    // The last bytes, one at a time.
    j += usize::try_from(prev_escaped).unwrap_or(0);
    loop {
        match s.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
        }
    }
}

/// Offset one past the end of the value starting at `i`.
fn skip_value(s: &[u8], i: usize) -> Option<usize> {
    match s.get(i)? {
        b'"' => skip_string(s, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match s.get(j)? {
                    b'"' => {
                        j = skip_string(s, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            // number / true / false / null
            let mut j = i;
            while let Some(b) = s.get(j) {
                if is_ws(*b) || matches!(b, b',' | b'}' | b']') {
                    break;
                }
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

fn decode_key(raw: &[u8]) -> Option<Cow<'_, str>> {
    if raw.contains(&b'\\') {
        serde_json::from_slice::<String>(raw).ok().map(Cow::Owned)
    } else {
        let inner = raw.get(1..raw.len().checked_sub(1)?)?;
        // A raw control character is not JSON (serde_json and Python's `json` refuse it).
        if inner.iter().any(|b| *b < 0x20) {
            return None;
        }
        std::str::from_utf8(inner).ok().map(Cow::Borrowed)
    }
}

/// One member as [`visit_object`] hands it over: its key (borrowed from the document unless it
/// has escapes) and its offsets, as in [`Member`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberRef<'a> {
    /// The key, with JSON escapes decoded.
    pub key: Cow<'a, str>,
    /// Byte offset of the key's opening quote.
    pub start: usize,
    /// Byte offset of the first byte of the value.
    pub value_start: usize,
    /// Byte offset one past the last byte of the value.
    pub value_end: usize,
}

/// [`scan_object`] without collecting: calls `on_member` with each top-level member in document
/// order, and returns the offsets of the braces (`(open, close)`), or `None` where
/// [`scan_object`] does (after the members before the fault were visited).
pub fn visit_object<'a>(s: &'a [u8], mut on_member: impl FnMut(MemberRef<'a>)) -> Option<(usize, usize)> {
    match visit_object_while(s, |m| {
        on_member(m);
        true
    })? {
        Visited::Whole(open, close) => Some((open, close)),
        Visited::Stopped => None,
    }
}

/// How far [`visit_object_while`] went.
enum Visited {
    /// Every member: the offsets of the braces.
    Whole(usize, usize),
    /// The visitor asked to stop.
    Stopped,
}

/// [`visit_object`] whose visitor says whether to go on (`false` stops the walk at once).
fn visit_object_while<'a>(s: &'a [u8], mut on_member: impl FnMut(MemberRef<'a>) -> bool) -> Option<Visited> {
    let open = skip_ws(s, 0);
    if s.get(open) != Some(&b'{') {
        return None;
    }
    let mut i = skip_ws(s, open + 1);
    if s.get(i) == Some(&b'}') {
        return Some(Visited::Whole(open, i));
    }
    loop {
        let start = i;
        let key_end = skip_string(s, start)?;
        let key = decode_key(s.get(start..key_end)?)?;
        i = skip_ws(s, key_end);
        if s.get(i) != Some(&b':') {
            return None;
        }
        let value_start = skip_ws(s, i + 1);
        let value_end = skip_value(s, value_start)?;
        if !on_member(MemberRef { key, start, value_start, value_end }) {
            return Some(Visited::Stopped);
        }
        i = skip_ws(s, value_end);
        match s.get(i)? {
            b',' => i = skip_ws(s, i + 1),
            b'}' => return Some(Visited::Whole(open, i)),
            _ => return None,
        }
    }
}

/// Scans the top-level members of the JSON object in `s` (leading/trailing whitespace allowed).
/// Returns `None` if `s` is not an object, or a key is not a valid JSON string. Bytes after the
/// closing brace are not looked at ([`ObjectScan::close`] says where it is).
pub fn scan_object(s: &[u8]) -> Option<ObjectScan> {
    scan_object_bounded(s, usize::MAX).flatten()
}

/// [`scan_object`] of an object of at most `max_members` members: `Some(None)` as soon as the
/// walk meets one more (the rest of the document is not looked at), so that a body of many small
/// members costs no more than the bound's worth of its bytes; `None` where [`scan_object`]
/// answers `None` before that.
pub fn scan_object_bounded(s: &[u8], max_members: usize) -> Option<Option<ObjectScan>> {
    let mut members = Vec::new();
    let visited = visit_object_while(s, |m| {
        if members.len() == max_members {
            return false;
        }
        members.push(Member {
            key: m.key.into_owned(),
            start: m.start,
            value_start: m.value_start,
            value_end: m.value_end,
        });
        true
    })?;
    Some(match visited {
        Visited::Whole(open, close) => Some(ObjectScan { open, close, members }),
        Visited::Stopped => None,
    })
}

/// The `(start, end)` byte ranges of the elements of the JSON array in `s`. `None` if `s` is not
/// an array.
pub fn array_elements(s: &[u8]) -> Option<Vec<(usize, usize)>> {
    let open = skip_ws(s, 0);
    if s.get(open) != Some(&b'[') {
        return None;
    }
    let mut out = Vec::new();
    let mut i = skip_ws(s, open + 1);
    if s.get(i) == Some(&b']') {
        return Some(out);
    }
    loop {
        let end = skip_value(s, i)?;
        out.push((i, end));
        i = skip_ws(s, end);
        match s.get(i)? {
            b',' => i = skip_ws(s, i + 1),
            b']' => return Some(out),
            _ => return None,
        }
    }
}

/// A lower bound on the UTF-8 bytes a JSON string (`s`, quotes included) decodes to, without
/// decoding it: its raw length less five bytes per escape (`\uXXXX`, six raw bytes, decodes to at
/// least one byte; a two-byte escape to one). 0 if `s` is not a string.
pub fn string_bytes_lower(s: &[u8]) -> u64 {
    let Some(inner) = s.strip_prefix(b"\"").and_then(|s| s.strip_suffix(b"\"")) else { return 0 };
    let escapes = inner.iter().filter(|&&b| b == b'\\').count() as u64;
    (inner.len() as u64).saturating_sub(5 * escapes)
}

/// One edit: replace `s[start..end]` with `with`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    /// First byte replaced.
    pub start: usize,
    /// One past the last byte replaced (`start` for a pure insertion).
    pub end: usize,
    /// Replacement bytes.
    pub with: Vec<u8>,
}

/// Applies non-overlapping `edits` to `s`. Returns `None` if an edit is out of range or edits
/// overlap.
pub fn apply_edits(s: &[u8], mut edits: Vec<Edit>) -> Option<Vec<u8>> {
    edits.sort_by_key(|e| (e.start, e.end));
    let extra: usize = edits.iter().map(|e| e.with.len()).sum();
    let mut out = Vec::with_capacity(s.len() + extra);
    let mut pos = 0usize;
    for e in edits {
        if e.start < pos || e.end < e.start {
            return None;
        }
        out.extend_from_slice(s.get(pos..e.start)?);
        out.extend_from_slice(&e.with);
        pos = e.end;
    }
    out.extend_from_slice(s.get(pos..)?);
    Some(out)
}

/// Applies non-overlapping `edits` to `s` in place (from the last edit back, each moving the
/// bytes after it once): no second buffer the size of `s`. Returns `None`, with `s` unchanged, if
/// an edit is out of range or edits overlap.
pub fn apply_edits_in_place(s: &mut Vec<u8>, mut edits: Vec<Edit>) -> Option<()> {
    edits.sort_by_key(|e| (e.start, e.end));
    let mut pos = 0usize;
    for e in &edits {
        if e.start < pos || e.end < e.start || e.end > s.len() {
            return None;
        }
        pos = e.end;
    }
    for e in edits.into_iter().rev() {
        s.splice(e.start..e.end, e.with);
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_in_place_equal_edits_into_a_copy() {
        let base = br#"{"model":"a","messages":[1,2,3],"stream":true}"#.to_vec();
        let cases = vec![
            vec![Edit { start: 9, end: 12, with: br#""served/name""#.to_vec() }],
            vec![
                Edit { start: 46, end: 46, with: br#","stream_options":{}"#.to_vec() },
                Edit { start: 9, end: 12, with: b"\"b\"".to_vec() },
            ],
            vec![Edit { start: 0, end: 1, with: Vec::new() }, Edit { start: 1, end: 1, with: b"{".to_vec() }],
        ];
        for edits in cases {
            let mut in_place = base.clone();
            apply_edits_in_place(&mut in_place, edits.clone()).unwrap();
            assert_eq!(Some(in_place), apply_edits(&base, edits));
        }
        let mut unchanged = base.clone();
        let overlapping =
            vec![Edit { start: 2, end: 6, with: vec![] }, Edit { start: 4, end: 8, with: vec![] }];
        assert_eq!(apply_edits_in_place(&mut unchanged, overlapping), None);
        let out_of_range = vec![Edit { start: 2, end: 999, with: vec![] }];
        assert_eq!(apply_edits_in_place(&mut unchanged, out_of_range), None);
        assert_eq!(unchanged, base);
    }

    /// Issue 16, item 5 (found by tests/parse_props.rs): a key with a raw control character is
    /// not JSON; the scanner took it (the large-body path then admitted what vLLM refuses).
    #[test]
    fn keys_with_raw_control_characters_are_refused() {
        for doc in ["{\"a\u{0}b\": 1}", "{\"k\": 1, \"\n\": 2}", "{\"\u{1f}\":1}"] {
            assert!(serde_json::from_str::<serde_json::Value>(doc).is_err());
            assert_eq!(scan_object(doc.as_bytes()), None, "{doc:?}");
        }
        let ok = scan_object(br#"{"a\u0000b": 1, "\n": 2}"#).unwrap();
        assert_eq!(ok.members.iter().map(|m| m.key.as_str()).collect::<Vec<_>>(), ["a\0b", "\n"]);
    }

    #[test]
    fn long_strings_at_every_alignment() {
        // Quotes and escapes at every offset of the 8-byte steps, checked against serde_json.
        for pad in 0..24 {
            for tail in [r#"\""#, r"\\", r"\n", r"\u00e9", "é😀"] {
                let text = format!("{}{tail}{}", "a".repeat(pad), "b".repeat(pad % 9));
                let doc = format!(r#"{{"k": "{text}", "z": 1}}"#);
                let scan = scan_object(doc.as_bytes()).unwrap();
                let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
                let k = scan.get("k").unwrap();
                let raw = doc.get(k.value_start..k.value_end).unwrap();
                assert_eq!(serde_json::from_str::<serde_json::Value>(raw).unwrap(), v["k"], "{doc}");
                assert_eq!(scan.members.len(), 2);
            }
        }
        let first = |w: &[u8; 8], b: u8| match byte_mask(u64::from_le_bytes(*w), b) {
            0 => None,
            m => Some(m.trailing_zeros() / 8),
        };
        assert_eq!(first(b"abcdefg\"", b'"'), Some(7));
        assert_eq!(first(b"abcdefgh", b'"'), None);
        assert_eq!(first(b"\\bcdefgh", b'\\'), Some(0));
        assert_eq!(first(&[0xa2; 8], b'"'), None);
        // Exact in every byte: '#' (0x23) next to '"' is not marked, every '"' is.
        let all = |w: &[u8; 8], b: u8| byte_mask(u64::from_le_bytes(*w), b);
        assert_eq!(all(b"ab\"#\"#gh", b'"'), 0x80 << 16 | 0x80 << 32);
        assert_eq!(all(b"\"#######", b'"'), 0x80);
        assert_eq!(
            all(&[0x22, 0x23, 0xa2, 0x00, 0x22, 0xff, 0x21, 0x22], b'"'),
            0x80 | 0x80 << 32 | 0x80 << 56
        );
    }

    #[test]
    fn escapes_across_64_byte_blocks() {
        // Strings of random pieces, runs of backslashes and escaped quotes landing on every
        // position of a 64-byte block and across blocks, checked against serde_json.
        let pieces = [r"\\", r#"\""#, r"\\\\", r#"\\\""#, r"\u00e9", r"\n", "a", "bcdefgh", "é", "😀", "#"];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..3000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut text = String::new();
            let mut r = state;
            for _ in 0..(r % 90) {
                r = r.rotate_left(5) ^ 0x9e37_79b9_7f4a_7c15;
                text.push_str(pieces[(r % pieces.len() as u64) as usize]);
            }
            let doc = format!(r#"{{"k": "{text}", "z": "{text}\\"}}"#);
            let v: serde_json::Value = serde_json::from_str(&doc).unwrap();
            let scan = scan_object(doc.as_bytes()).unwrap();
            assert_eq!(scan.members.len(), 2, "{doc}");
            for key in ["k", "z"] {
                let m = scan.get(key).unwrap();
                let raw = doc.get(m.value_start..m.value_end).unwrap();
                assert_eq!(serde_json::from_str::<serde_json::Value>(raw).unwrap(), v[key], "{doc}");
            }
        }
    }

    fn keys(s: &str) -> Vec<String> {
        scan_object(s.as_bytes()).unwrap().members.into_iter().map(|m| m.key).collect()
    }

    #[test]
    fn scans_members() {
        let s = r#" { "a" : 1 , "b":{"x":[1,{"}":"]"}]}, "c\u0041":"s\"}", "d":null,"e":[ ] } "#;
        let scan = scan_object(s.as_bytes()).unwrap();
        assert_eq!(keys(s), vec!["a", "b", "cA", "d", "e"]);
        let b = scan.get("b").unwrap();
        assert_eq!(&s[b.value_start..b.value_end], r#"{"x":[1,{"}":"]"}]}"#);
        let c = scan.get("cA").unwrap();
        assert_eq!(&s[c.value_start..c.value_end], r#""s\"}""#);
        let d = scan.get("d").unwrap();
        assert_eq!(&s[d.value_start..d.value_end], "null");
        assert_eq!(&s[scan.close..=scan.close], "}");
    }

    #[test]
    fn empty_and_non_objects() {
        assert_eq!(scan_object(b"{}").unwrap().members, vec![]);
        assert!(scan_object(b"[]").is_none());
        assert!(scan_object(b"\"x\"").is_none());
        assert!(scan_object(b"{\"a\":1").is_none());
        assert!(scan_object(b"").is_none());
    }

    #[test]
    fn duplicates_and_last_wins() {
        let s = r#"{"model":"a","x":1,"model":"b"}"#;
        let scan = scan_object(s.as_bytes()).unwrap();
        assert_eq!(scan.first_duplicate(), Some("model"));
        let m = scan.get("model").unwrap();
        assert_eq!(&s[m.value_start..m.value_end], r#""b""#);
        assert_eq!(scan_object(br#"{"a":1,"b":2}"#).unwrap().first_duplicate(), None);
    }

    /// `{"0":0,"1":0,...}` of distinct short keys, `bytes` long or just under, with `dup` (if
    /// any) appended as the last member's key.
    fn short_members(bytes: usize, dup: Option<&str>) -> (String, usize) {
        let mut s = String::with_capacity(bytes);
        s.push('{');
        let mut n = 0usize;
        loop {
            let member = format!("\"{n:x}\":0,");
            if s.len() + member.len() + 16 > bytes {
                break;
            }
            s.push_str(&member);
            n += 1;
        }
        match dup {
            Some(k) => {
                s.push_str(&format!("\"{k}\":1}}"));
                n += 1;
            }
            None => {
                s.pop();
                s.push('}');
            }
        }
        (s, n)
    }

    /// Issue 17, item 3: the duplicate check is linear. Key comparisons are counted (not wall
    /// time): comparing every member with every earlier one made n(n-1)/2 of them.
    #[test]
    fn duplicate_check_work_is_linear() {
        // A small body first, so that a quadratic check fails fast (20,000 members: 2 * 10^8).
        for bytes in [200_000, 4 * 1024 * 1024] {
            for dup in [None, Some("1")] {
                let (body, n) = short_members(bytes, dup);
                let scan = scan_object(body.as_bytes()).unwrap();
                assert_eq!(scan.members.len(), n);
                let before = key_comparisons();
                assert_eq!(scan.first_duplicate(), dup);
                let work = key_comparisons() - before;
                assert!(work <= 4 * n as u64, "{work} key comparisons for {n} members ({bytes} bytes)");
                if bytes > 1_000_000 && dup.is_none() {
                    assert!(n > 350_000, "{n} members in 4 MiB");
                    println!("{n} members in {} bytes: {work} key comparisons", body.len());
                }
            }
        }
    }

    #[test]
    fn first_duplicate_is_the_first_repeat_in_document_order() {
        let s = r#"{"a":1,"b":2,"c":3,"b":4,"a":5}"#;
        assert_eq!(scan_object(s.as_bytes()).unwrap().first_duplicate(), Some("b"));
        // Keys are compared decoded: "\u0061" is "a".
        let s = r#"{"a":1,"x":2,"\u0061":3}"#;
        assert_eq!(scan_object(s.as_bytes()).unwrap().first_duplicate(), Some("a"));
        assert_eq!(scan_object(b"{}").unwrap().first_duplicate(), None);
    }

    #[test]
    fn removal_ranges() {
        let remove = |s: &str, k: usize| {
            let scan = scan_object(s.as_bytes()).unwrap();
            let (a, b) = scan.removal_range(k).unwrap();
            format!("{}{}", &s[..a], &s[b..])
        };
        assert_eq!(remove(r#"{"a":1,"usage":null,"b":2}"#, 1), r#"{"a":1,"b":2}"#);
        assert_eq!(remove(r#"{"a":1,"usage":null}"#, 1), r#"{"a":1}"#);
        assert_eq!(remove(r#"{"usage":null,"a":1}"#, 0), r#"{"a":1}"#);
        assert_eq!(remove(r#"{"usage":null}"#, 0), r#"{}"#);
        assert_eq!(remove(r#"{"a": 1, "usage": null, "b": 2}"#, 1), r#"{"a": 1, "b": 2}"#);
    }

    #[test]
    fn edits() {
        let s = b"0123456789";
        let out = apply_edits(
            s,
            vec![
                Edit { start: 8, end: 9, with: b"X".to_vec() },
                Edit { start: 2, end: 2, with: b"++".to_vec() },
                Edit { start: 0, end: 1, with: vec![] },
            ],
        )
        .unwrap();
        assert_eq!(out, b"1++234567X9");
        assert!(apply_edits(
            s,
            vec![Edit { start: 2, end: 5, with: vec![] }, Edit { start: 3, end: 4, with: vec![] }]
        )
        .is_none());
        assert!(apply_edits(s, vec![Edit { start: 9, end: 12, with: vec![] }]).is_none());
    }

    #[test]
    fn array_elements_and_string_lower_bounds() {
        let s = br#"[ {"a": [1, "]"]}, "x\"y" ,3]"#;
        let e = array_elements(s).unwrap();
        let parts: Vec<&[u8]> = e.iter().map(|&(a, b)| &s[a..b]).collect();
        assert_eq!(parts, [&br#"{"a": [1, "]"]}"#[..], br#""x\"y""#, b"3"]);
        assert_eq!(array_elements(b"[]").unwrap(), []);
        assert_eq!(array_elements(b"{}"), None);
        // "a\u00e9b" decodes to 4 bytes; the bound is 8 - 5 = 3.
        assert_eq!(string_bytes_lower(br#""a\u00e9b""#), 3);
        assert_eq!(string_bytes_lower(br#""plain""#), 5);
        assert_eq!(string_bytes_lower(br#""\\""#), 0);
        assert_eq!(string_bytes_lower(b"12"), 0);
    }
}
