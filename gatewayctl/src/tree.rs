//! Small helpers over [`serde_yaml_ng::Value`], the tree every rendered file is written from (its
//! mappings keep insertion order: a typed document's members in their declaration order, a
//! template's keys as the template lists them), and the YAML writer.

pub use serde_yaml_ng::{Mapping, Value};

/// A serializable value as a tree: a struct's members in their declaration order.
///
/// # Errors
/// A value YAML cannot represent (a bug).
pub fn to_tree<T: serde::Serialize + ?Sized>(value: &T) -> Result<Value, String> {
    serde_yaml_ng::to_value(value).map_err(|e| e.to_string())
}

/// One step of a path into a tree.
#[derive(Debug, Clone, Copy)]
pub enum Key<'a> {
    /// A mapping key.
    Field(&'a str),
    /// A sequence index.
    Index(usize),
}

impl<'a> From<&'a str> for Key<'a> {
    fn from(k: &'a str) -> Self {
        Key::Field(k)
    }
}

impl From<usize> for Key<'_> {
    fn from(i: usize) -> Self {
        Key::Index(i)
    }
}

/// The node at `path`, if every step exists.
pub fn at_mut<'v>(value: &'v mut Value, path: &[Key<'_>]) -> Option<&'v mut Value> {
    let mut node = value;
    for key in path {
        node = match key {
            Key::Field(k) => node.get_mut(*k)?,
            Key::Index(i) => node.get_mut(*i)?,
        };
    }
    Some(node)
}

/// Sets `key` in a mapping node (appends when new, replaces in place when present).
/// Returns false when `node` is not a mapping.
pub fn set(node: &mut Value, key: &str, value: Value) -> bool {
    match node.as_mapping_mut() {
        Some(m) => {
            m.insert(Value::String(key.to_owned()), value);
            true
        }
        None => false,
    }
}

/// Sets every member of the mapping `members` in the mapping `node`, in order, as [`set`] does.
/// Returns false when either is not a mapping.
pub fn merge(node: &mut Value, members: Value) -> bool {
    match (node.as_mapping_mut(), members) {
        (Some(m), Value::Mapping(members)) => {
            for (key, value) in members {
                m.insert(key, value);
            }
            true
        }
        _ => false,
    }
}

/// Serializes a value as one line of JSON (for template placeholders and JSON files).
///
/// # Errors
/// A mapping key that is not a string (JSON cannot represent it).
pub fn to_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<String, String> {
    serde_json::to_string(value).map_err(|e| e.to_string())
}

/// Serializes a tree as block-style YAML that YAML 1.1 readers (kubectl, PyYAML) and YAML 1.2
/// readers parse to the same values: a string is written plain only when it cannot be read as
/// anything else in either version (`no`, `on`, `1s`, `0.0.0.0:80` are quoted), and a
/// multi-line string ending in one newline (an embedded config file) as a `|` literal block.
///
/// # Errors
/// A tagged value or a non-string mapping key (none is built by this crate).
pub fn to_yaml(value: &Value) -> Result<String, String> {
    let mut out = String::new();
    match value {
        Value::Mapping(m) if !m.is_empty() => emit_mapping(m, 0, false, &mut out)?,
        Value::Sequence(items) if !items.is_empty() => emit_sequence(items, 0, &mut out)?,
        other => {
            out.push_str(&inline(other)?.ok_or("unexpected value")?);
            out.push('\n');
        }
    }
    Ok(out)
}

/// Whether a string can be written without quotes and read back as the same string by YAML 1.1
/// and 1.2 readers.
fn plain_safe(s: &str) -> bool {
    let mut bytes = s.bytes();
    let first_ok = matches!(bytes.next(), Some(b) if b.is_ascii_alphabetic() || b == b'_' || b == b'/');
    first_ok
        && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'/' | b'-'))
        && !matches!(
            s.to_ascii_lowercase().as_str(),
            "y" | "n" | "yes" | "no" | "on" | "off" | "true" | "false" | "null"
        )
}

fn quote(s: &str) -> String {
    if plain_safe(s) {
        s.to_owned()
    } else {
        // A JSON string is a YAML double-quoted scalar.
        serde_json::Value::String(s.to_owned()).to_string()
    }
}

/// A string written as a `|` literal block: several lines, one final newline, nothing a
/// literal block cannot carry.
fn literal_block(s: &str) -> bool {
    s.contains('\n')
        && s.ends_with('\n')
        && !s.ends_with("\n\n")
        && !s.starts_with([' ', '\n'])
        && !s.contains(['\r', '\t'])
        && s.lines().all(|l| !l.ends_with(' '))
}

/// The one-line form of a scalar or an empty collection; `None` for what needs a block.
fn inline(value: &Value) -> Result<Option<String>, String> {
    Ok(Some(match value {
        Value::Null => "null".to_owned(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) if literal_block(s) => return Ok(None),
        Value::String(s) => quote(s),
        Value::Sequence(items) if items.is_empty() => "[]".to_owned(),
        Value::Mapping(m) if m.is_empty() => "{}".to_owned(),
        Value::Sequence(_) | Value::Mapping(_) => return Ok(None),
        Value::Tagged(_) => return Err("tagged values are not rendered".to_owned()),
    }))
}

fn push_indent(out: &mut String, indent: usize) {
    out.extend(std::iter::repeat_n(' ', indent));
}

fn emit_literal(s: &str, indent: usize, out: &mut String) {
    out.push_str("|\n");
    for line in s.lines() {
        if !line.is_empty() {
            push_indent(out, indent);
            out.push_str(line);
        }
        out.push('\n');
    }
}

/// Writes what follows `key:` or `- ` (the separator is written here).
fn emit_after(value: &Value, indent: usize, in_sequence: bool, out: &mut String) -> Result<(), String> {
    if let Some(text) = inline(value)? {
        out.push(' ');
        out.push_str(&text);
        out.push('\n');
        return Ok(());
    }
    match value {
        Value::String(s) => {
            out.push(' ');
            emit_literal(s, indent + 2, out);
            Ok(())
        }
        Value::Mapping(m) if in_sequence => {
            out.push(' ');
            emit_mapping(m, indent + 2, true, out)
        }
        Value::Mapping(m) => {
            out.push('\n');
            emit_mapping(m, indent + 2, false, out)
        }
        Value::Sequence(items) => {
            out.push('\n');
            emit_sequence(items, if in_sequence { indent + 2 } else { indent }, out)
        }
        _ => Err("unexpected value".to_owned()),
    }
}

fn emit_mapping(m: &Mapping, indent: usize, first_inline: bool, out: &mut String) -> Result<(), String> {
    for (i, (key, value)) in m.iter().enumerate() {
        let key = key.as_str().ok_or("mapping keys must be strings")?;
        if !(first_inline && i == 0) {
            push_indent(out, indent);
        }
        out.push_str(&quote(key));
        out.push(':');
        emit_after(value, indent, false, out)?;
    }
    Ok(())
}

fn emit_sequence(items: &[Value], indent: usize, out: &mut String) -> Result<(), String> {
    for item in items {
        push_indent(out, indent);
        out.push('-');
        emit_after(item, indent, true, out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map<K: Into<String>>(pairs: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Mapping(pairs.into_iter().map(|(k, v)| (Value::String(k.into()), v)).collect())
    }

    fn s(x: &str) -> Value {
        Value::String(x.to_owned())
    }

    fn n(x: u64) -> Value {
        Value::from(x)
    }

    fn seq(items: impl IntoIterator<Item = Value>) -> Value {
        Value::Sequence(items.into_iter().collect())
    }

    fn strings<'a>(items: impl IntoIterator<Item = &'a str>) -> Value {
        seq(items.into_iter().map(s))
    }

    #[test]
    fn ambiguous_strings_are_quoted() {
        let v = map([
            ("a", strings(["no", "On", "1s", "", "0.0.0.0:80", "%X%", "a b", "y"])),
            ("@type", s("type.googleapis.com/x.y")),
            ("path", s("/health")),
            ("n", n(5)),
            ("f", Value::from(0.95)),
            ("b", Value::Bool(false)),
        ]);
        let text = to_yaml(&v).unwrap();
        assert_eq!(
            text,
            "a:\n- \"no\"\n- \"On\"\n- \"1s\"\n- \"\"\n- \"0.0.0.0:80\"\n- \"%X%\"\n- \"a b\"\n- \"y\"\n\
             \"@type\": type.googleapis.com/x.y\npath: /health\n\"n\": 5\nf: 0.95\nb: false\n"
        );
        assert_eq!(serde_yaml_ng::from_str::<Value>(&text).unwrap(), v);
    }

    #[test]
    fn nested_structures_round_trip() {
        let v = map([
            (
                "list",
                seq([
                    map([("name", s("x")), ("inner", map([("k", seq([n(1), n(2)]))]))]),
                    seq([s("a"), seq([])]),
                    map::<&str>([]),
                ]),
            ),
            ("file", s("listen: 127.0.0.1:1\nredis:\n  url: x\n\ntenants: []\n")),
            ("oneline", s("no newline at end\nsecond")),
            ("empty", map::<&str>([])),
        ]);
        let text = to_yaml(&v).unwrap();
        assert!(
            text.contains("file: |\n  listen: 127.0.0.1:1\n  redis:\n    url: x\n\n  tenants: []\n"),
            "{text}"
        );
        assert_eq!(serde_yaml_ng::from_str::<Value>(&text).unwrap(), v, "{text}");
    }
}
