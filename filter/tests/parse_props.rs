//! Property tests (issue 16, item 5): the filter's own scanner (`json_scan`) and serde_json read
//! generated request bodies the same way, and the filter's rewrite changes exactly what it says.
//!
//! Bodies are generated as JSON text, not as values: strings with every escape form (`\uXXXX`,
//! surrogate pairs, `\/`, raw UTF-8), numbers in every JSON form (`1e3`, `100.0`, `1E+2`, `-0`,
//! integers past `u64`), arbitrary whitespace, nesting and duplicate keys, and sometimes one byte
//! mutated. The properties:
//!
//! * `scan_object` on a body serde_json accepts finds exactly the top-level members of the text,
//!   each value slice parses to what serde_json kept for that key, and `first_duplicate` is set
//!   exactly when a key repeats;
//! * the pipeline admits a body only when every field it reads has the strict JSON type (an
//!   integer for `max_tokens`/`max_completion_tokens`/`n`/`best_of`, a boolean for `stream` and
//!   `include_usage`, a string for `model`): then pydantic's lax mode reads the same values
//!   (`"100"`, `100.0`, `1e3`, `"true"` would read as 100 and true there, and are refused here);
//! * the rewritten body parses to the original plus exactly the edits (`model` set to the served
//!   name, `stream_options.include_usage: true` for a stream that did not ask for usage);
//! * the reservation is `max_tokens` times the sequences vLLM generates, read from the body;
//! * the large-body path (top-level members only) decides as the full parse does.
//!
//! The same properties hold for Responses API bodies (issue 15, item 5: `input`, `instructions`,
//! `max_output_tokens`), which are never rewritten but for `model`.
//!
//! `PROPTEST_CASES` sets the number of cases (CI: the default below; `make fuzz`: many more).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use gateway_filter::config::Config;
use gateway_filter::json_scan::scan_object;
use gateway_filter::pipeline::{on_request_body_owned, on_request_headers, ForwardPlan, HeadersDecision};
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, FileFailurePersistence};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// A JSON value as text to be rendered: numbers keep their spelling, strings their escapes.
#[derive(Debug, Clone)]
enum J {
    Null,
    Bool(bool),
    /// A number spelled as given (always valid JSON number syntax).
    Num(String),
    /// A string and, per char, how to spell it (0: raw where allowed, 1: `\uXXXX`, 2: short escape).
    Str(String, Vec<u8>),
    Arr(Vec<J>, Vec<u8>),
    /// Members (duplicates allowed) and whitespace choices.
    Obj(Vec<(J, J)>, Vec<u8>),
}

/// The clock the properties decide at (no key here has a window): 2026-07-01T00:00:00Z.
const NOW_S: u64 = 1_782_864_000;

const WS: [&str; 6] = ["", " ", "\n", "\t", "\r\n  ", "   "];

fn ws(choices: &[u8], i: usize) -> &'static str {
    WS[usize::from(choices.get(i % choices.len().max(1)).copied().unwrap_or(0)) % WS.len()]
}

fn render_str(out: &mut String, s: &str, style: &[u8]) {
    out.push('"');
    for (i, c) in s.chars().enumerate() {
        let st = style.get(i % style.len().max(1)).copied().unwrap_or(0) % 3;
        match c {
            '"' if st == 2 => out.push_str("\\\""),
            '\\' if st == 2 => out.push_str("\\\\"),
            '/' if st == 2 => out.push_str("\\/"),
            '\n' if st == 2 => out.push_str("\\n"),
            '\t' if st == 2 => out.push_str("\\t"),
            c if st == 1 || c == '"' || c == '\\' || (c as u32) < 0x20 => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn render(out: &mut String, j: &J) {
    match j {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Num(n) => out.push_str(n),
        J::Str(s, style) => render_str(out, s, style),
        J::Arr(items, w) => {
            out.push('[');
            out.push_str(ws(w, 0));
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(ws(w, 2 * i));
                    out.push(',');
                    out.push_str(ws(w, 2 * i + 1));
                }
                render(out, x);
            }
            out.push_str(ws(w, 1));
            out.push(']');
        }
        J::Obj(members, w) => {
            out.push('{');
            out.push_str(ws(w, 0));
            for (i, (k, v)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    out.push_str(ws(w, 3 * i));
                }
                render(out, k);
                out.push_str(ws(w, 3 * i + 1));
                out.push(':');
                out.push_str(ws(w, 3 * i + 2));
                render(out, v);
            }
            out.push_str(ws(w, 1));
            out.push('}');
        }
    }
}

fn text(j: &J) -> String {
    let mut s = String::new();
    render(&mut s, j);
    s
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        (0u64..40).prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("1e3".to_string()),
        Just("1E+2".to_string()),
        Just("100.0".to_string()),
        Just("1.5".to_string()),
        Just("-0".to_string()),
        Just("0.0".to_string()),
        Just("-1".to_string()),
        Just("18446744073709551616".to_string()),
        Just("123456789012345678901234567890".to_string()),
        Just("1e400".to_string()),
        Just("5e-1".to_string()),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(|f| format!("{f:e}")),
    ]
}

fn string_value() -> impl Strategy<Value = J> {
    let chars = prop_oneof![
        Just("".to_string()),
        "[a-z]{0,12}",
        "\\PC{0,12}",
        Just("é😀\"\\/\n\tA".to_string()),
        Just("model".to_string()),
    ];
    (chars, prop::collection::vec(any::<u8>(), 1..6)).prop_map(|(s, st)| J::Str(s, st))
}

fn any_json() -> impl Strategy<Value = J> {
    let leaf = prop_oneof![
        Just(J::Null),
        any::<bool>().prop_map(J::Bool),
        number().prop_map(J::Num),
        string_value(),
    ];
    leaf.prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            (prop::collection::vec(inner.clone(), 0..5), prop::collection::vec(any::<u8>(), 1..4))
                .prop_map(|(v, w)| J::Arr(v, w)),
            (prop::collection::vec((string_value(), inner), 0..5), prop::collection::vec(any::<u8>(), 1..4))
                .prop_map(|(m, w)| J::Obj(m, w)),
        ]
    })
}

fn key(s: &str) -> impl Strategy<Value = J> {
    let s = s.to_string();
    prop::collection::vec(any::<u8>(), 1..4).prop_map(move |st| J::Str(s.clone(), st))
}

/// The top-level keys the filter reads (`model` and the prompt keys less often: every body has
/// them already, so they make duplicates), and a few others.
fn known_key() -> impl Strategy<Value = J> {
    prop_oneof![
        6 => prop_oneof![
            key("max_tokens"),
            key("max_completion_tokens"),
            key("n"),
            key("best_of"),
            key("stream"),
            key("stream"),
            key("stream_options"),
            key("temperature"),
            key("user"),
            key("max_output_tokens"),
            key("instructions"),
        ],
        1 => prop_oneof![key("model"), key("messages"), key("prompt"), key("input")],
    ]
    .boxed()
}

fn int_like() -> impl Strategy<Value = J> {
    prop_oneof![
        24 => (1u64..50).prop_map(|n| J::Num(n.to_string())),
        1 => number().prop_map(J::Num),
        1 => Just(J::Null),
        1 => Just(J::Str("100".into(), vec![0])),
        1 => Just(J::Num("100.0".into())),
        1 => Just(J::Num("1e1".into())),
        1 => Just(J::Bool(true)),
        1 => Just(J::Num("0".into())),
    ]
}

fn bool_like() -> impl Strategy<Value = J> {
    prop_oneof![
        24 => any::<bool>().prop_map(J::Bool),
        1 => Just(J::Null),
        1 => Just(J::Str("true".into(), vec![0])),
        1 => Just(J::Num("1".into())),
        1 => Just(J::Num("0".into())),
    ]
}

fn model_value() -> impl Strategy<Value = J> {
    let names = prop_oneof![
        Just("qwen"),
        Just("qwen-latest"),
        Just("llama"),
        Just("tiny"),
        Just("sql-lora"),
        Just("Qwen/Qwen2.5-0.5B-Instruct"),
        Just("nope"),
        Just("QWEN"),
        Just("qwen "),
        Just(""),
    ];
    prop_oneof![
        24 => (names, prop::collection::vec(any::<u8>(), 1..4)).prop_map(|(n, st)| J::Str(n.to_string(), st)),
        1 => Just(J::Null),
        1 => Just(J::Num("5".into())),
        1 => Just(J::Arr(vec![J::Str("qwen".into(), vec![0])], vec![0])),
    ]
}

fn message() -> impl Strategy<Value = J> {
    let role = prop_oneof![Just("user"), Just("system"), Just("assistant")];
    let content = prop_oneof![
        6 => string_value(),
        1 => Just(J::Null),
        2 => prop::collection::vec(string_value(), 0..3).prop_map(|texts| J::Arr(
            texts.into_iter().map(|t| J::Obj(vec![
                (J::Str("type".into(), vec![0]), J::Str("text".into(), vec![1])),
                (J::Str("text".into(), vec![0]), t),
            ], vec![0])).collect(), vec![1])),
        1 => any_json(),
    ];
    (
        role,
        content,
        prop::collection::vec((string_value(), any_json()), 0..2),
        prop::collection::vec(any::<u8>(), 1..3),
    )
        .prop_map(|(r, c, extra, w)| {
            let mut m = vec![
                (J::Str("role".into(), vec![2]), J::Str(r.into(), vec![0])),
                (J::Str("content".into(), vec![1]), c),
            ];
            m.extend(extra);
            J::Obj(m, w)
        })
}

fn prompt_value() -> impl Strategy<Value = J> {
    prop_oneof![
        6 => string_value(),
        2 => prop::collection::vec(string_value(), 0..4).prop_map(|v| J::Arr(v, vec![0])),
        1 => prop::collection::vec(number(), 0..5).prop_map(|v| J::Arr(v.into_iter().map(J::Num).collect(), vec![1])),
        1 => prop::collection::vec(prop::collection::vec(0u32..1000, 0..4), 0..3).prop_map(|v| J::Arr(
            v.into_iter().map(|t| J::Arr(t.into_iter().map(|x| J::Num(x.to_string())).collect(), vec![0])).collect(), vec![2])),
        1 => any_json(),
    ]
}

/// A Responses API `input`: a string, or items: messages (`type` absent or `"message"`, string or
/// `input_text` / `output_text` parts), other items (`function_call_output`, item references).
fn input_value() -> impl Strategy<Value = J> {
    let part = (
        prop_oneof![Just("input_text"), Just("output_text"), Just("text"), Just("input_image")],
        string_value(),
    )
        .prop_map(|(t, text)| {
            J::Obj(
                vec![
                    (J::Str("type".into(), vec![0]), J::Str(t.into(), vec![0])),
                    (J::Str("text".into(), vec![1]), text),
                ],
                vec![0],
            )
        });
    let content = prop_oneof![
        4 => string_value(),
        1 => Just(J::Null),
        2 => prop::collection::vec(part, 0..3).prop_map(|v| J::Arr(v, vec![1])),
        1 => any_json(),
    ];
    let item = prop_oneof![
        4 => (message(), any::<bool>()).prop_map(|(m, typed)| match m {
            J::Obj(mut members, w) if typed => {
                members.insert(0, (J::Str("type".into(), vec![0]), J::Str("message".into(), vec![0])));
                J::Obj(members, w)
            }
            other => other,
        }),
        2 => (prop_oneof![Just("user"), Just("assistant"), Just("developer")], content).prop_map(|(r, c)| J::Obj(vec![
            (J::Str("role".into(), vec![0]), J::Str(r.into(), vec![0])),
            (J::Str("content".into(), vec![0]), c),
        ], vec![0])),
        1 => string_value().prop_map(|o| J::Obj(vec![
            (J::Str("type".into(), vec![0]), J::Str("function_call_output".into(), vec![0])),
            (J::Str("call_id".into(), vec![0]), J::Str("c".into(), vec![0])),
            (J::Str("output".into(), vec![0]), o),
        ], vec![0])),
        1 => Just(J::Obj(vec![(J::Str("id".into(), vec![0]), J::Str("ref_1".into(), vec![0]))], vec![0])),
        1 => any_json(),
    ];
    prop_oneof![
        6 => string_value(),
        6 => prop::collection::vec(item, 0..4).prop_map(|v| J::Arr(v, vec![0, 1])),
        1 => any_json(),
    ]
}

fn stream_options_value() -> impl Strategy<Value = J> {
    prop_oneof![
        1 => Just(J::Null),
        1 => Just(J::Obj(vec![], vec![0])),
        3 => (bool_like(), prop::collection::vec((string_value(), any_json()), 0..2), any::<bool>(), prop::collection::vec(any::<u8>(), 1..3))
            .prop_map(|(iu, extra, dup, w)| {
                let mut m = extra;
                m.push((J::Str("include_usage".into(), vec![1, 0]), iu));
                if dup {
                    m.insert(0, (J::Str("include_usage".into(), vec![0]), J::Bool(false)));
                }
                J::Obj(m, w)
            }),
        1 => any_json(),
    ]
}

fn value_for(key: &str) -> BoxedStrategy<J> {
    match key {
        "model" => model_value().boxed(),
        "max_tokens" | "max_completion_tokens" | "n" | "best_of" | "max_output_tokens" => int_like().boxed(),
        "input" => input_value().boxed(),
        "instructions" => prop_oneof![6 => string_value(), 1 => Just(J::Null), 1 => any_json()].boxed(),
        "stream" => bool_like().boxed(),
        "stream_options" => stream_options_value().boxed(),
        "messages" => prop_oneof![
            12 => prop::collection::vec(message(), 1..4).prop_map(|v| J::Arr(v, vec![0, 1])),
            1 => any_json(),
        ]
        .boxed(),
        "prompt" => prompt_value().boxed(),
        _ => any_json().boxed(),
    }
}

fn key_name(j: &J) -> String {
    match j {
        J::Str(s, _) => s.clone(),
        _ => String::new(),
    }
}

/// The API a generated body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completions,
    Responses,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Responses => "/v1/responses",
        }
    }

    fn prompt_key(self) -> &'static str {
        match self {
            Api::Chat => "messages",
            Api::Completions => "prompt",
            Api::Responses => "input",
        }
    }
}

/// A request body: the prompt member and `model` most of the time, then known and unknown
/// members in any order, sometimes a duplicate.
fn request_body(api: Api) -> impl Strategy<Value = J> {
    let prompt_key = api.prompt_key();
    let members = prop::collection::vec(
        prop_oneof![3 => known_key(), 1 => string_value()].prop_flat_map(|k| {
            let name = key_name(&k);
            (Just(k), value_for(&name))
        }),
        0..6,
    );
    (
        prop::option::weighted(0.95, (key(prompt_key), value_for(prompt_key))),
        prop::option::weighted(0.95, (key("model"), model_value())),
        members,
        any::<u64>(),
        prop::collection::vec(any::<u8>(), 1..5),
    )
        .prop_map(|(p, m, mut rest, order, w)| {
            let mut all: Vec<(J, J)> = p.into_iter().chain(m).collect();
            all.append(&mut rest);
            // Duplicate keys in one body of five (the filter refuses them all).
            if order % 5 != 0 {
                let mut seen = std::collections::HashSet::new();
                all.retain(|(k, _)| seen.insert(key_name(k)));
            }
            // A deterministic shuffle from `order`.
            let len = all.len().max(1);
            all.rotate_left((order as usize) % len);
            if order % 7 == 0 && all.len() > 2 {
                all.swap(0, 2);
            }
            J::Obj(all, w)
        })
}

fn hash_key(k: &str) -> String {
    hex::encode(Sha256::digest(k.as_bytes()))
}

fn config(full_parse_max_bytes: u64) -> Config {
    let v = json!({
        "max_body_bytes": 1 << 20,
        "full_parse_max_bytes": full_parse_max_bytes,
        "tenants": [
            {"id": "demo", "api_keys_sha256": [hash_key("sk-demo")], "models": ["qwen", "tiny", "llama"]}
        ],
        "models": [
            {"name": "qwen", "pool": "pool_a", "served_model_name": "Qwen/Qwen2.5-0.5B-Instruct",
             "max_model_len": 1000000, "aliases": ["qwen-latest"], "lora_adapters": ["sql-lora"]},
            {"name": "llama", "pool": "pool_b", "max_model_len": 1000000},
            {"name": "tiny", "pool": "pool_t", "max_model_len": 100, "max_token_bytes": 4},
            {"name": "private", "pool": "pool_p", "max_model_len": 4096}
        ]
    });
    match Config::from_json(v.to_string().as_bytes()) {
        Ok(c) => c,
        Err(e) => panic!("test config: {e}"),
    }
}

fn plan(cfg: &Config, path: &str, body: &[u8]) -> Result<ForwardPlan, (u32, Value)> {
    let headers: Vec<(String, Vec<u8>)> = [
        (":method", "POST"),
        (":path", path),
        ("authorization", "Bearer sk-demo"),
        ("content-length", "1"),
        ("x-request-id", "rid"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
    .collect();
    let pending = match on_request_headers(cfg, &headers, NOW_S).decision {
        HeadersDecision::AwaitBody(p) => p,
        HeadersDecision::Reply(r) => panic!("headers refused: {r:?}"),
    };
    on_request_body_owned(cfg, &pending, body.to_vec()).map_err(|e| {
        let r = e.to_reply();
        (r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null))
    })
}

fn cases(default: u32) -> PtConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    PtConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Off)),
        ..PtConfig::default()
    }
}

/// Bytes that matter to a JSON reader (control characters, quotes, escapes, structure, invalid
/// UTF-8), drawn for half of the mutations.
const SHARP_BYTES: &[u8] = b"\x00\x1f\"\\{}[],: \n\xff\xc3";

/// Flips, inserts, deletes or appends one byte at a position picked by `at`, for one `kind` in
/// `rate / 4` (none for the others).
fn mutate(mut body: Vec<u8>, kind: u8, at: usize, byte: u8, rate: u8) -> Vec<u8> {
    if body.is_empty() {
        return body;
    }
    let i = at % body.len();
    let byte =
        if byte.is_multiple_of(2) { SHARP_BYTES[usize::from(byte / 2) % SHARP_BYTES.len()] } else { byte };
    match kind % rate {
        0 => body[i] = byte,
        1 => body.insert(i, byte),
        2 => {
            body.remove(i);
        }
        3 => body.push(byte),
        _ => {}
    }
    body
}

/// The number of members, in text order, of the top-level object as written.
fn written_keys(j: &J) -> Vec<String> {
    match j {
        J::Obj(m, _) => m.iter().map(|(k, _)| key_name(k)).collect(),
        _ => Vec::new(),
    }
}

/// The pydantic-lax hazards: a field the filter reads, present with a value whose strict JSON
/// type is not what the filter requires (pydantic would coerce some of these).
fn strict_types_ok(obj: &Map<String, Value>, api: Api) -> bool {
    let int = |k: &str| obj.get(k).is_none_or(|v| v.is_null() || v.is_u64() || v.is_i64());
    let boolean = |v: Option<&Value>| v.is_none_or(|v| v.is_null() || v.is_boolean());
    let model_ok = obj.get("model").is_some_and(Value::is_string);
    if api == Api::Responses {
        // `stream_options` is not read there: vLLM's Responses streams end with their usage.
        let instructions = obj.get("instructions").is_none_or(|v| v.is_null() || v.is_string());
        let input = obj.get("input").is_some_and(|v| v.is_string() || v.is_array());
        return model_ok && instructions && input && int("max_output_tokens") && boolean(obj.get("stream"));
    }
    let chat = api == Api::Chat;
    let so_ok = match obj.get("stream_options") {
        None | Some(Value::Null) => true,
        Some(Value::Object(o)) => boolean(o.get("include_usage")),
        Some(_) => false,
    };
    let ints = ["max_tokens", "n"].iter().all(|k| int(k))
        && if chat { int("max_completion_tokens") } else { int("best_of") };
    model_ok && so_ok && ints && boolean(obj.get("stream"))
}

fn positive(obj: &Map<String, Value>, k: &str) -> Option<u64> {
    obj.get(k).and_then(Value::as_u64)
}

/// The body as the filter rewrote it, parsed.
fn forwarded(plan: &ForwardPlan, body: &[u8]) -> Value {
    let bytes = plan.new_body.as_deref().unwrap_or(body);
    match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => panic!("rewritten body does not parse: {e}: {}", String::from_utf8_lossy(bytes)),
    }
}

/// What the served name of `canonical` is in [`config`].
fn served_name(canonical: &str, sent: &str) -> String {
    match (canonical, sent) {
        (_, "sql-lora") => "sql-lora".into(),
        ("qwen", _) => "Qwen/Qwen2.5-0.5B-Instruct".into(),
        (other, _) => other.into(),
    }
}

fn check_request(api: Api, j: &J, mutation: (u8, usize, u8)) -> Result<(), TestCaseError> {
    let path = api.path();
    let chat = api == Api::Chat;
    let body = mutate(text(j).into_bytes(), mutation.0, mutation.1, mutation.2, 16);
    let full = plan(&config(1 << 20), path, &body);
    let large = plan(&config(16), path, &body);
    let parsed: Option<Value> = serde_json::from_slice(&body).ok();

    // The large path (scanner + per-member parse) admits what the full parse admits, the same way.
    match (&full, &large) {
        (Ok(f), Ok(l)) => {
            prop_assert_eq!((&f.facts.model, &f.facts.pool), (&l.facts.model, &l.facts.pool));
            prop_assert_eq!(forwarded(f, &body), forwarded(l, &body));
            prop_assert_eq!(f.usage_injected, l.usage_injected);
            prop_assert_eq!(f.stream, l.stream);
        }
        (Err(_), Err(_)) => {}
        // The large path does not validate the prompt member (vLLM does), so it may admit what the
        // full parse refuses for its prompt alone, never for any other member.
        (Err((_, e)), Ok(_)) => {
            let param = e["error"]["param"].as_str().unwrap_or_default();
            let prompt_key = api.prompt_key();
            // Invalid JSON inside the prompt member, which the large path leaves to vLLM (whose
            // own JSON parser refuses the whole body).
            let prompt_invalid = scan_object(&body)
                .and_then(|s| s.get(prompt_key).map(|m| body[m.value_start..m.value_end].to_vec()))
                .is_some_and(|raw| serde_json::from_slice::<Value>(&raw).is_err());
            prop_assert!(
                param.starts_with(prompt_key)
                    || e["error"]["code"] == "context_length_exceeded"
                    || (e["error"]["code"] == "invalid_json" && prompt_invalid),
                "large path admitted what the full parse refused: {e} {}",
                String::from_utf8_lossy(&body)
            );
        }
        (Ok(_), Err((_, e))) => {
            // Only when the body is not valid JSON as a whole can the full parse... it cannot:
            // the full parse is the stricter one.
            prop_assert!(
                false,
                "full parse admitted, large path refused: {e} {}",
                String::from_utf8_lossy(&body)
            );
        }
    }

    let Ok(plan) = full else { return Ok(()) };
    let Some(Value::Object(obj)) = parsed else {
        return Err(TestCaseError::fail("admitted a body serde_json refuses"));
    };
    // No top-level duplicate was admitted (Python's json keeps the last, serde_json too, but the
    // filter refuses them so that no reader can pick another).
    let scan = scan_object(&body).ok_or_else(|| TestCaseError::fail("admitted body does not scan"))?;
    prop_assert!(scan.first_duplicate().is_none());
    prop_assert!(
        strict_types_ok(&obj, api),
        "admitted a lax-typed field: {}",
        String::from_utf8_lossy(&body)
    );

    // The reservation is read from the same values.
    if api == Api::Responses {
        // max_output_tokens, capped at what the context leaves after the prompt's estimate
        // (context::responses_budget; the other models' max_model_len is 1,000,000).
        if let Some(cap) = positive(&obj, "max_output_tokens") {
            prop_assert!(plan.facts.max_tokens <= cap, "{} > {cap}", plan.facts.max_tokens);
            if plan.facts.pool != "pool_t" {
                let left = 1_000_000u64.saturating_sub(plan.facts.prompt_tokens);
                prop_assert_eq!(plan.facts.max_tokens, cap.min(left));
            }
        }
    }
    let prompts = if api != Api::Completions {
        1
    } else {
        match obj.get("prompt") {
            Some(Value::Array(a)) if a.iter().all(|x| x.is_string() || x.is_array()) => a.len() as u64,
            _ => 1,
        }
    };
    let cap = if chat {
        positive(&obj, "max_completion_tokens").or(positive(&obj, "max_tokens"))
    } else {
        positive(&obj, "max_tokens")
    };
    let n = positive(&obj, "n").unwrap_or(1);
    let choices = if chat { n } else { positive(&obj, "best_of").unwrap_or(n).max(n) };
    if let (Some(cap), false) = (cap, api == Api::Responses) {
        prop_assert_eq!(plan.facts.max_tokens, cap.saturating_mul(choices).saturating_mul(prompts));
    }

    // The model routed is the model the body names, and the forwarded body names its served name.
    let sent = obj.get("model").and_then(Value::as_str).unwrap_or_default();
    let canonical = match sent {
        "qwen" | "qwen-latest" | "sql-lora" | "Qwen/Qwen2.5-0.5B-Instruct" => "qwen",
        other => other,
    };
    let facts_model = if sent == "sql-lora" { "sql-lora" } else { canonical };
    prop_assert_eq!(plan.facts.model.as_str(), facts_model);

    // The forwarded body is the original plus exactly the edits.
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let asked_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    prop_assert_eq!(plan.stream, stream);
    prop_assert_eq!(plan.usage_injected, stream && !asked_usage && api != Api::Responses);
    let mut expected = obj.clone();
    expected.insert("model".into(), Value::String(served_name(canonical, sent)));
    if plan.usage_injected {
        match expected.get_mut("stream_options") {
            Some(Value::Object(o)) => {
                o.insert("include_usage".into(), Value::Bool(true));
            }
            _ => {
                expected.insert("stream_options".into(), json!({"include_usage": true}));
            }
        }
    }
    prop_assert_eq!(forwarded(&plan, &body), Value::Object(expected));
    if let Some(new) = &plan.new_body {
        let again = scan_object(new).ok_or_else(|| TestCaseError::fail("rewritten body does not scan"))?;
        prop_assert!(again.first_duplicate().is_none());
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(512))]

    /// The scanner's top-level members are serde_json's, for any object text serde_json accepts
    /// (and it never panics on text serde_json refuses).
    #[test]
    fn scanner_agrees_with_serde_json(
        j in prop::collection::vec((prop_oneof![known_key(), string_value()], any_json()), 0..8)
            .prop_flat_map(|m| (Just(m), prop::collection::vec(any::<u8>(), 1..5)))
            .prop_map(|(m, w)| J::Obj(m, w)),
        lead in 0usize..WS.len(),
        trail in 0usize..WS.len(),
        mutation in (any::<u8>(), any::<usize>(), any::<u8>()),
    ) {
        let raw = format!("{}{}{}", WS[lead], text(&j), WS[trail]).into_bytes();
        let raw = mutate(raw, mutation.0, mutation.1, mutation.2, 8);
        let scan = scan_object(&raw);
        let Ok(Value::Object(map)) = serde_json::from_slice::<Value>(&raw) else { return Ok(()) };
        let scan = scan.ok_or_else(|| TestCaseError::fail("serde_json accepts, the scanner does not"))?;
        let keys: Vec<&str> = scan.members.iter().map(|m| m.key.as_str()).collect();
        if mutation.0 % 8 > 3 {
            prop_assert_eq!(keys.clone(), written_keys(&j));
        }
        for m in &scan.members {
            let v: Value = serde_json::from_slice(&raw[m.value_start..m.value_end])
                .map_err(|e| TestCaseError::fail(format!("member {} does not parse alone: {e}", m.key)))?;
            if scan.get(&m.key).map(|last| last.start) == Some(m.start) {
                prop_assert_eq!(Some(&v), map.get(&m.key));
            }
        }
        let distinct: std::collections::BTreeSet<&str> = keys.iter().copied().collect();
        prop_assert_eq!(distinct.len(), map.len());
        prop_assert_eq!(scan.first_duplicate().is_some(), keys.len() != map.len());
    }

    /// Chat bodies: admitted only with strict types, reserved and rewritten as read.
    #[test]
    fn chat_bodies_are_read_as_serde_json_reads_them(
        j in request_body(Api::Chat),
        mutation in (any::<u8>(), any::<usize>(), any::<u8>()),
    ) {
        check_request(Api::Chat, &j, mutation)?;
    }

    /// Completions bodies: the same, with `prompt` forms and `best_of`.
    #[test]
    fn completions_bodies_are_read_as_serde_json_reads_them(
        j in request_body(Api::Completions),
        mutation in (any::<u8>(), any::<usize>(), any::<u8>()),
    ) {
        check_request(Api::Completions, &j, mutation)?;
    }

    /// Responses API bodies: `input` in its forms, `instructions`, `max_output_tokens`; only
    /// `model` rewritten (no `stream_options` injected).
    #[test]
    fn responses_bodies_are_read_as_serde_json_reads_them(
        j in request_body(Api::Responses),
        mutation in (any::<u8>(), any::<usize>(), any::<u8>()),
    ) {
        check_request(Api::Responses, &j, mutation)?;
    }
}
