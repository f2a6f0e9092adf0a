//! Chat-template rendering as vLLM does it: the OpenAI `messages` become vLLM's conversation
//! (`vllm/entrypoints/chat_utils.py`: text parts joined with `\n` for the `string` content
//! format), rendered by minijinja configured as transformers configures jinja2
//! (`transformers/utils/chat_template_utils.py`: `trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, `strftime_now`, a `tojson` that is Python's `json.dumps` with
//! `ensure_ascii=False`), with `messages`, `tools=None`, `documents=None`,
//! `add_generation_prompt` and the tokenizer's special tokens as variables.

use std::path::Path;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::spec::{spec_error, ChatTemplateSpec, ContentFormat, SpecError};
use crate::TokenizeError;

const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template with its special-token variables.
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` (those known).
    specials: Map<String, Json>,
    content_format: ContentFormat,
}

impl ChatTemplate {
    pub(crate) fn load(spec: &ChatTemplateSpec) -> Result<Self, SpecError> {
        spec.validate()?;
        let mut source: Option<String> = None;
        let mut specials = Map::new();
        if let Some(path) = &spec.tokenizer_config {
            let (template, tokens) = read_tokenizer_config(path)?;
            source = template;
            specials = tokens;
        }
        if let Some(path) = &spec.jinja {
            source = Some(
                std::fs::read_to_string(path)
                    .map_err(|e| spec_error("chat_template.jinja", format!("{}: {e}", path.display())))?,
            );
        }
        if let Some(b) = &spec.bos_token {
            specials.insert("bos_token".into(), Json::String(b.clone()));
        }
        if let Some(e) = &spec.eos_token {
            specials.insert("eos_token".into(), Json::String(e.clone()));
        }
        let source = source.ok_or_else(|| {
            spec_error("chat_template.tokenizer_config", "has no `chat_template` (set `chat_template.jinja`)")
        })?;
        let field =
            if spec.jinja.is_some() { "chat_template.jinja" } else { "chat_template.tokenizer_config" };
        Ok(ChatTemplate {
            env: environment(source).map_err(|e| spec_error(field, e.to_string()))?,
            specials,
            content_format: spec.content_format,
        })
    }

    /// Renders `messages` (the OpenAI request's array) with `add_generation_prompt` and the
    /// request's `chat_template_kwargs` (`extra`, which cannot replace `messages`, `tools`,
    /// `documents` or `add_generation_prompt`).
    pub(crate) fn render(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Map<String, Json>>,
    ) -> Result<String, TokenizeError> {
        let conversation = conversation(messages, self.content_format)?;
        let mut vars = self.specials.clone();
        if let Some(extra) = extra {
            for (k, v) in extra {
                if !matches!(k.as_str(), "messages" | "tools" | "documents" | "add_generation_prompt") {
                    vars.insert(k.clone(), v.clone());
                }
            }
        }
        vars.insert("messages".into(), Json::Array(conversation));
        vars.insert("tools".into(), Json::Null);
        vars.insert("documents".into(), Json::Null);
        vars.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        let template =
            self.env.get_template(TEMPLATE_NAME).map_err(|e| TokenizeError::Template(e.to_string()))?;
        template
            .render(Value::from_serialize(&vars))
            .map_err(|e| TokenizeError::Template(template_error_text(&e)))
    }
}

fn template_error_text(e: &Error) -> String {
    match e.detail() {
        Some(d) if e.kind() == ErrorKind::InvalidOperation => d.to_string(),
        _ => e.to_string(),
    }
}

/// Reads `chat_template` (string, or the `default` entry of a `[{name, template}]` list) and the
/// special-token strings (plain strings or `{"content": ...}` objects) of a
/// `tokenizer_config.json`.
fn read_tokenizer_config(path: &Path) -> Result<(Option<String>, Map<String, Json>), SpecError> {
    let field = "chat_template.tokenizer_config";
    let at = |m: String| spec_error(field, format!("{}: {m}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| at(e.to_string()))?;
    let config: Json = serde_json::from_str(&text).map_err(|e| at(e.to_string()))?;
    let template = match config.get("chat_template") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(Json::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(str::to_string),
        Some(_) => return Err(at("`chat_template` must be a string or a list".into())),
    };
    let mut specials = Map::new();
    for name in ["bos_token", "eos_token", "unk_token", "pad_token"] {
        let value = match config.get(name) {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(str::to_string),
            _ => None,
        };
        if let Some(v) = value {
            specials.insert(name.into(), Json::String(v));
        }
    }
    Ok((template, specials))
}

fn environment(source: String) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE_NAME, source)?;
    Ok(env)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// vLLM's conversation from OpenAI messages (`_parse_chat_message_content` and
/// `_postprocess_messages`). Anything whose rendering this crate cannot reproduce exactly is
/// [`TokenizeError::Unsupported`]: non-text content parts (images, audio: vLLM adds placeholder
/// tokens), and `tool_calls` (key order of their JSON arguments).
fn conversation(messages: &Json, format: ContentFormat) -> Result<Vec<Json>, TokenizeError> {
    let list = messages
        .as_array()
        .ok_or_else(|| TokenizeError::InvalidMessages("`messages` must be an array".into()))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let m = m
            .as_object()
            .ok_or_else(|| TokenizeError::InvalidMessages(format!("messages[{i}] must be an object")))?;
        let role = m
            .get("role")
            .and_then(Json::as_str)
            .ok_or_else(|| TokenizeError::InvalidMessages(format!("messages[{i}].role must be a string")))?;
        let texts: Vec<&str> = match m.get("content") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::String(s)) => vec![s.as_str()],
            Some(Json::Array(parts)) => {
                let mut texts = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Json::as_str), p.get("text").and_then(Json::as_str)) {
                        (Some("text"), Some(t)) => texts.push(t),
                        _ => {
                            return Err(TokenizeError::Unsupported(format!(
                                "messages[{i}].content[{j}] is not a text part"
                            )))
                        }
                    }
                }
                texts
            }
            Some(_) => {
                return Err(TokenizeError::InvalidMessages(format!(
                    "messages[{i}].content must be a string or an array"
                )))
            }
        };
        if m.get("tool_calls").is_some_and(|t| !t.is_null()) {
            return Err(TokenizeError::Unsupported(format!("messages[{i}].tool_calls")));
        }
        let content = match format {
            ContentFormat::String => Json::String(texts.join("\n")),
            ContentFormat::Openai => {
                Json::Array(texts.iter().map(|t| serde_json::json!({"type": "text", "text": t})).collect())
            }
        };
        let mut msg = Map::new();
        msg.insert("role".into(), Json::String(role.to_string()));
        msg.insert("content".into(), content);
        if role == "tool" {
            if let Some(id) = m.get("tool_call_id").filter(|v| !v.is_null()) {
                msg.insert("tool_call_id".into(), id.clone());
            }
        }
        if role == "assistant" {
            let reasoning = m
                .get("reasoning")
                .filter(|v| !v.is_null())
                .or_else(|| m.get("reasoning_content").filter(|v| !v.is_null()));
            if let Some(r) = reasoning {
                msg.insert("reasoning".into(), r.clone());
                msg.insert("reasoning_content".into(), r.clone());
            }
        }
        if let Some(Json::String(name)) = m.get("name") {
            msg.insert("name".into(), Json::String(name.clone()));
        }
        out.push(Json::Object(msg));
    }
    Ok(out)
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, not HTML-escaped.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (_, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ))
            }
        },
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if !s.is_none() => {
            let mut it = s.try_iter()?;
            let (Some(a), Some(b)) = (it.next(), it.next()) else {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair"));
            };
            (a.to_string(), b.to_string())
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts { ensure_ascii, indent, sort_keys, item_sep, key_sep };
    let mut out = String::new();
    write_json(&mut out, value, &opts, 0)?;
    Ok(Value::from(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

fn newline(out: &mut String, opts: &JsonOpts, level: usize) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, level: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                write_json(out, item, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline(out, opts, level + 1);
                match k.as_str() {
                    Some(s) => write_json_str(out, s, opts),
                    None => write_json_str(out, &k.to_string(), opts),
                }
                out.push_str(&opts.key_sep);
                write_json(out, &v.get_item(k)?, opts, level + 1)?;
            }
            newline(out, opts, level);
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a value of kind {}", v.kind()),
            ))
        }
    }
    Ok(())
}

/// A JSON string as Python's `json.dumps` writes it.
fn write_json_str(out: &mut String, s: &str, opts: &JsonOpts) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (opts.ensure_ascii && (c as u32) > 0x7e) => {
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

/// Python's `repr(float)`: shortest round-trip digits, fixed notation for exponents in
/// `-4..16` (always with a fractional part), else `d.ddde+XX`.
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let s = if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!("{digits}{}.0", "0".repeat((int_len - n) as usize))
            } else {
                let (a, b) = digits.split_at(int_len as usize);
                format!("{a}.{b}")
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{s}")
    } else {
        let (first, rest) = digits.split_at(1);
        let m = if rest.is_empty() { first.to_string() } else { format!("{first}.{rest}") };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.abs())
    }
}

/// transformers' `strftime_now(format)`: the current time (here in UTC) formatted with the
/// common `strftime` directives (`%d %m %Y %y %b %B %a %A %H %I %M %S %p %j %%`); others are
/// kept as written.
fn strftime_now(format: String) -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    strftime(&format, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

fn strftime(format: &str, unix_secs: u64) -> String {
    let days = unix_secs / 86_400;
    let rem = unix_secs % 86_400;
    let (hour, minute, second) = (rem / 3600, (rem % 3600) / 60, rem % 60);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = ((days + 3) % 7) as usize; // 1970-01-01 was a Thursday (index 3 from Monday)
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday =
        cumulative.get((month - 1) as usize).copied().unwrap_or(0) + day + i64::from(leap && month > 2);
    let month_name = MONTHS.get((month - 1) as usize).copied().unwrap_or("");
    let day_name = DAYS.get(weekday).copied().unwrap_or("");
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(month_name.get(..3).unwrap_or("")),
            Some('B') => out.push_str(month_name),
            Some('a') => out.push_str(day_name.get(..3).unwrap_or("")),
            Some('A') => out.push_str(day_name),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn env_for(source: &str) -> Environment<'static> {
        environment(source.to_string()).unwrap()
    }

    fn render(source: &str, ctx: Json) -> Result<String, Error> {
        env_for(source).get_template(TEMPLATE_NAME)?.render(Value::from_serialize(&ctx))
    }

    #[test]
    fn python_floats() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456.789, "123456.789"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (-0.0, "-0.0"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
        ] {
            assert_eq!(py_float_repr(f), s, "{f}");
        }
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let ctx = json!({"x": {"b": [1, 2.5, "é\"\n\u{1}", null, true], "a": {}}});
        assert_eq!(
            render("{{ x | tojson }}", ctx.clone()).unwrap(),
            r#"{"a": {}, "b": [1, 2.5, "é\"\n\u0001", null, true]}"#
        );
        assert_eq!(
            render("{{ x.b | tojson(indent=2) }}", ctx.clone()).unwrap(),
            "[\n  1,\n  2.5,\n  \"é\\\"\\n\\u0001\",\n  null,\n  true\n]"
        );
        assert_eq!(
            render("{{ x.b[2] | tojson(ensure_ascii=true) }}", ctx.clone()).unwrap(),
            r#""\u00e9\"\n\u0001""#
        );
        assert_eq!(render("{{ '😀<>&' | tojson }}", ctx).unwrap(), "\"😀<>&\"");
    }

    #[test]
    fn jinja2_whitespace_control_as_transformers() {
        // trim_blocks + lstrip_blocks, and the final newline dropped (keep_trailing_newline off).
        let src = "{% for m in messages %}\n    {% if true %}\n{{ m }}|\n    {% endif %}\n{% endfor %}\n";
        let out = render(src, json!({"messages": ["a", "b"]})).unwrap();
        assert_eq!(out, "a|\nb|\n");
    }

    #[test]
    fn pycompat_methods_and_raise_exception() {
        let out = render(
            "{{ s.strip() }}|{{ s.startswith(' a') }}|{{ s.split('b')[-1].lstrip() }}|{{ d.get('k', 'none') }}",
            json!({"s": " abc ", "d": {}}),
        )
        .unwrap();
        assert_eq!(out, "abc|True|c |none"); // as jinja2 prints them
        let e = render("{{ raise_exception('roles must alternate') }}", json!({})).unwrap_err();
        assert_eq!(template_error_text(&e), "roles must alternate");
    }

    #[test]
    fn loop_controls() {
        let out = render(
            "{% for i in [1,2,3,4] %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}",
            json!({}),
        )
        .unwrap();
        assert_eq!(out, "13");
    }

    #[test]
    fn strftime_formats() {
        // 2024-07-26 13:05:09 UTC was a Friday, day 208 of a leap year.
        let t = 1_721_999_109;
        assert_eq!(
            strftime("%d %b %Y|%A %a|%B %m %y|%H:%M:%S %I%p|%j|%%|%Q", t),
            "26 Jul 2024|Friday Fri|July 07 24|13:05:09 01PM|208|%|%Q"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %j", 951_782_400), "2000-02-29 060");
    }

    #[test]
    fn conversation_as_vllm_builds_it() {
        let msgs = json!([
            {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "hi", "name": "bob"},
            {"role": "assistant", "content": null, "reasoning_content": "hmm"},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"}
        ]);
        let c = conversation(&msgs, ContentFormat::String).unwrap();
        assert_eq!(
            Json::Array(c),
            json!([
                {"role": "system", "content": "a\nb"},
                {"role": "user", "content": "hi", "name": "bob"},
                {"role": "assistant", "content": "", "reasoning": "hmm", "reasoning_content": "hmm"},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}
            ])
        );
        let c = conversation(&json!([{"role": "user", "content": "x"}]), ContentFormat::Openai).unwrap();
        assert_eq!(Json::Array(c), json!([{"role": "user", "content": [{"type": "text", "text": "x"}]}]));
    }

    #[test]
    fn conversation_refuses_what_it_cannot_reproduce() {
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]);
        assert!(matches!(conversation(&image, ContentFormat::String), Err(TokenizeError::Unsupported(_))));
        let calls = json!([{"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]}]);
        assert!(matches!(conversation(&calls, ContentFormat::String), Err(TokenizeError::Unsupported(_))));
        assert!(matches!(
            conversation(&json!({}), ContentFormat::String),
            Err(TokenizeError::InvalidMessages(_))
        ));
        assert!(matches!(
            conversation(&json!([{"content": "x"}]), ContentFormat::String),
            Err(TokenizeError::InvalidMessages(_))
        ));
    }
}
