//! `gatewayctl keys add | revoke | list`: a tenant's API keys in the gateway config file, edited
//! as text so that its comments and layout stay as they were.
//!
//! The edit touches only the tenant's `api_keys` (or, to revoke a key listed by its digest alone,
//! `api_keys_sha256`): an entry is added as one flow mapping line at the end of the list (the
//! field is added at the end of the tenant's entry when it has none), or its lines removed. It
//! reads the block-style YAML the examples use: `tenants:` a block sequence of block mappings, the
//! key lists either block sequences or one-line flow sequences (`[...]`); anything else is refused
//! with what to change by hand. The result must load with the strict loader and render every
//! configured target, and must hold the change (checked by loading it), before it is returned;
//! [`write_atomically`] then replaces the file by rename.

use std::path::Path;

use gateway_filter::auth::{format_utc_timestamp, parse_utc_timestamp};
use gateway_filter::config::is_key_name;

use crate::config::{Loaded, TenantSection};
use crate::render::{render, Target};

/// A key to add: its name and optional validity window (RFC 3339 UTC, as the options give them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NewKey {
    /// The key's name.
    pub name: String,
    /// `--not-before`.
    pub not_before: Option<String>,
    /// `--expires-at`.
    pub expires_at: Option<String>,
}

/// One row of `keys list`: never the key, only its digest's first 12 hex digits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRow {
    /// The key's name (`sha256:<12 hex>` for a key listed by its digest alone).
    pub name: String,
    /// `sha256:` and the digest's first 12 hex digits.
    pub digest_prefix: String,
    /// `not_before`, or `-`.
    pub not_before: String,
    /// `expires_at`, or `-`.
    pub expires_at: String,
    /// `valid`, `expired` or `not yet valid` at the time given to [`list`].
    pub state: &'static str,
    /// Whether the key has limits of its own.
    pub own_limits: bool,
}

/// The config `text` with a key of digest `digest` (the SHA-256 of the new key, lowercase hex)
/// added to tenant `tenant`'s `api_keys`. `file` names the config in errors.
///
/// # Errors
/// An unknown tenant, a name that is invalid or taken in the tenant, an option that does not
/// read, a layout this edit does not handle, or a result that does not validate.
pub fn add(text: &str, file: &str, tenant: &str, new: &NewKey, digest: &str) -> Result<String, String> {
    let loaded = load(text, file)?;
    let (index, section) = find_tenant(&loaded, tenant)?;
    if !is_key_name(&new.name) {
        return Err(format!("--name: '{}' must be 1 to 128 letters, digits, '.', '_' or '-'", new.name));
    }
    if section.keys().iter().any(|(name, _, _)| *name == new.name) {
        return Err(format!("tenant '{tenant}' already has a key named '{}' (revoke it first)", new.name));
    }
    for (option, value) in [("--not-before", &new.not_before), ("--expires-at", &new.expires_at)] {
        if value.as_deref().is_some_and(|v| parse_utc_timestamp(v).is_none()) {
            return Err(format!("{option}: must be an RFC 3339 time in UTC, YYYY-MM-DDTHH:MM:SSZ"));
        }
    }
    let doc = Doc::new(text);
    let item = doc.tenant_item(index, tenant)?;
    let entry = flow_entry(new, digest);
    let edited = match doc.field(&item, "api_keys")? {
        Some(field) => doc.append(&field, &entry),
        None => doc.insert_field(&item, "api_keys", &entry),
    };
    let after = load(&edited, file).map_err(|e| format!("the edited config does not validate: {e}"))?;
    let (_, section) = find_tenant(&after, tenant)?;
    if !section.keys().iter().any(|(name, d, _)| *name == new.name && *d == digest) {
        return Err("the edited config does not hold the new key (nothing written)".to_owned());
    }
    Ok(edited)
}

/// The config `text` without tenant `tenant`'s key named `name` (a named key of `api_keys`, or
/// `sha256:<12 hex>` for one of `api_keys_sha256`). A tenant's last key is not revoked: a tenant
/// needs one (add its next key first, or remove the tenant).
///
/// # Errors
/// An unknown tenant or key, the tenant's last key, a layout this edit does not handle, or a
/// result that does not validate.
pub fn revoke(text: &str, file: &str, tenant: &str, name: &str) -> Result<String, String> {
    let loaded = load(text, file)?;
    let (index, section) = find_tenant(&loaded, tenant)?;
    let keys = section.keys();
    let Some((_, digest, named)) = keys.iter().find(|(n, _, _)| n == name) else {
        let names: Vec<&str> = keys.iter().map(|(n, _, _)| n.as_str()).collect();
        return Err(format!("tenant '{tenant}' has no key named '{name}' (its keys: {})", names.join(", ")));
    };
    if keys.len() == 1 {
        return Err(format!(
            "'{name}' is tenant '{tenant}''s last key: add its next key first (a tenant needs one), or remove the tenant"
        ));
    }
    let doc = Doc::new(text);
    let item = doc.tenant_item(index, tenant)?;
    let list = if named.is_some() { "api_keys" } else { "api_keys_sha256" };
    let field =
        doc.field(&item, list)?.ok_or_else(|| format!("tenant '{tenant}': no {list} found in the text"))?;
    let edited = doc.remove(&field, |entry| entry_matches(entry, named.is_some(), name, digest))?;
    let after = load(&edited, file).map_err(|e| format!("the edited config does not validate: {e}"))?;
    let (_, section) = find_tenant(&after, tenant)?;
    if section.keys().iter().any(|(n, _, _)| n == name) || section.keys().len() + 1 != keys.len() {
        return Err("the edit did not remove exactly that key (nothing written)".to_owned());
    }
    Ok(edited)
}

/// The keys of tenant `tenant` as `keys list` prints them, their state at `now_s` (Unix seconds).
///
/// # Errors
/// An unknown tenant.
pub fn list(loaded: &Loaded, tenant: &str, now_s: u64) -> Result<Vec<KeyRow>, String> {
    let (_, section) = find_tenant(loaded, tenant)?;
    Ok(section
        .keys()
        .into_iter()
        .map(|(name, digest, named)| {
            let (from, to) = named.map(|k| k.window()).unwrap_or_default();
            let window = gateway_filter::auth::KeyWindow { not_before: from, expires_at: to };
            let state = match window.check(now_s) {
                Ok(()) => "valid",
                Err(gateway_filter::error::GatewayError::ApiKeyExpired) => "expired",
                Err(_) => "not yet valid",
            };
            KeyRow {
                name,
                digest_prefix: gateway_filter::config::derived_key_name(digest),
                not_before: from.map_or_else(|| "-".to_owned(), format_utc_timestamp),
                expires_at: to.map_or_else(|| "-".to_owned(), format_utc_timestamp),
                state,
                own_limits: named.is_some_and(|k| k.limits.is_some()),
            }
        })
        .collect())
}

/// `rows` as a table: name, digest prefix, not before, expires at, state, own limits.
pub fn format_rows(rows: &[KeyRow]) -> String {
    let mut out = format!(
        "{:<32} {:<20} {:<20} {:<20} {:<13} {}\n",
        "NAME", "DIGEST", "NOT_BEFORE", "EXPIRES_AT", "STATE", "OWN_LIMITS"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<32} {:<20} {:<20} {:<20} {:<13} {}\n",
            r.name,
            r.digest_prefix,
            r.not_before,
            r.expires_at,
            r.state,
            if r.own_limits { "yes" } else { "no" }
        ));
    }
    out
}

/// Replaces the file at `path` with `text`: written beside it, synced, then renamed over it
/// (its permissions kept), so that a reader sees the old file or the new one, never a part.
///
/// # Errors
/// What failed, with the path.
pub fn write_atomically(path: &Path, text: &str) -> Result<(), String> {
    use std::io::Write as _;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = dir.join(format!(".{name}.keys-{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        if let Ok(meta) = std::fs::metadata(path) {
            f.set_permissions(meta.permissions())?;
        }
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("{}: {e}", path.display())
    })
}

/// Loads config text strictly and renders every configured target in memory (as `gatewayctl
/// validate` does).
fn load(text: &str, file: &str) -> Result<Loaded, String> {
    let dir = Path::new(file).parent().map(Path::to_path_buf).unwrap_or_default();
    let loaded = Loaded::from_yaml(text, file, dir).map_err(|e| e.to_string())?;
    render(&loaded, Target::All).map_err(|e| e.to_string())?;
    Ok(loaded)
}

fn find_tenant<'a>(loaded: &'a Loaded, tenant: &str) -> Result<(usize, &'a TenantSection), String> {
    loaded.config.tenants.iter().enumerate().find(|(_, t)| t.id == tenant).ok_or_else(|| {
        let ids: Vec<&str> = loaded.config.tenants.iter().map(|t| t.id.as_str()).collect();
        format!("{}: no tenant '{tenant}' (tenants: {})", loaded.file, ids.join(", "))
    })
}

/// The new entry as one flow mapping, every scalar quoted (a name such as `2026` or a digest of
/// digits and `e` stays a string).
fn flow_entry(new: &NewKey, digest: &str) -> String {
    let mut entry = format!("{{name: \"{}\", sha256: \"{digest}\"", new.name);
    if let Some(t) = &new.not_before {
        entry.push_str(&format!(", not_before: \"{t}\""));
    }
    if let Some(t) = &new.expires_at {
        entry.push_str(&format!(", expires_at: \"{t}\""));
    }
    entry.push('}');
    entry
}

/// Whether one list entry's text is the key to remove: a named key's mapping by its `name`, or a
/// digest of `api_keys_sha256` by its value.
fn entry_matches(entry: &str, named: bool, name: &str, digest: &str) -> bool {
    let Ok(value) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(entry) else { return false };
    if named {
        value.get("name").and_then(serde_yaml_ng::Value::as_str) == Some(name)
    } else {
        value.as_str() == Some(digest)
    }
}

/// The file's lines, each with its line ending.
struct Doc<'a> {
    lines: Vec<&'a str>,
}

/// A block sequence item: lines `start..end` (`end` past its last content line), its mapping's
/// keys at column `key_indent`.
struct Item {
    start: usize,
    end: usize,
    key_indent: usize,
}

/// A key list field of a tenant: its line, and how its entries are written.
struct Field {
    line: usize,
    list: List,
}

enum List {
    /// `name: [a, b]` on the field's line.
    Flow,
    /// `name:` then `- entry` lines at column `indent`: each entry's lines.
    Block { indent: usize, entries: Vec<(usize, usize)> },
}

impl<'a> Doc<'a> {
    fn new(text: &'a str) -> Self {
        Self { lines: text.split_inclusive('\n').collect() }
    }

    /// The tenant at `index` of the top-level `tenants` block sequence, checked to be `id`.
    fn tenant_item(&self, index: usize, id: &str) -> Result<Item, String> {
        let top = self
            .lines
            .iter()
            .position(|l| l.starts_with("tenants:"))
            .ok_or("no top-level `tenants:` line")?;
        if !value_text(self.line(top), "tenants:").is_empty() {
            return Err("`tenants:` is written as a flow sequence: write it as a block sequence (`- id: ...` lines) to edit keys with gatewayctl".to_owned());
        }
        let (indent, items) = self.block_items(top, 0);
        let &(start, end) =
            items.get(index).ok_or("the tenants in the text do not match the loaded config")?;
        let after_dash = self.line(start).get(indent + 1..).unwrap_or_default();
        if after_dash.trim_start().starts_with('{') {
            return Err(format!(
                "tenants[{index}] is written as a flow mapping ({{...}}): write it as a block mapping to edit its keys with gatewayctl"
            ));
        }
        let key_indent = indent + 1 + (after_dash.len() - after_dash.trim_start().len());
        let parsed: Option<serde_yaml_ng::Value> =
            serde_yaml_ng::from_str(&self.dedented(start, end, indent)).ok();
        let found = parsed.as_ref().and_then(|v| v.get(0)?.get("id")?.as_str().map(str::to_owned));
        if found.as_deref() != Some(id) {
            return Err(format!("tenants[{index}] in the text is not tenant '{id}'"));
        }
        Ok(Item { start, end, key_indent })
    }

    /// The item's field `name` (a key list), if it has one.
    fn field(&self, item: &Item, name: &str) -> Result<Option<Field>, String> {
        let key = format!("{name}:");
        let found = (item.start..item.end).find(|&i| {
            let line = self.line(i);
            (i == item.start || indent_of(line) == item.key_indent)
                && line.get(item.key_indent..).is_some_and(|rest| rest.starts_with(&key))
        });
        let Some(line) = found else { return Ok(None) };
        let value = value_text(self.line(line), &key);
        let list = if value.is_empty() {
            let (indent, entries) = self.block_items(line, item.key_indent);
            List::Block { indent, entries }
        } else if value.starts_with('[') && value.ends_with(']') {
            List::Flow
        } else {
            return Err(format!("`{name}` is written in a form gatewayctl does not edit: make it a block sequence or a one-line [...]"));
        };
        Ok(Some(Field { line, list }))
    }

    /// The text with `entry` added at the end of `field`'s list.
    fn append(&self, field: &Field, entry: &str) -> String {
        let mut out: Vec<String> = self.lines.iter().map(|l| (*l).to_owned()).collect();
        match &field.list {
            List::Block { indent, entries } => {
                let at = entries.last().map_or(field.line + 1, |&(_, end)| end);
                let indent = if entries.is_empty() { indent_of(self.line(field.line)) + 2 } else { *indent };
                insert_lines(&mut out, at, &[format!("{}- {entry}", " ".repeat(indent))]);
            }
            List::Flow => {
                let line = self.line(field.line);
                let (open, close) = flow_bounds(line);
                let inner = line.get(open + 1..close).unwrap_or_default();
                let joined = if inner.trim().is_empty() {
                    entry.to_owned()
                } else {
                    format!("{}, {entry}", inner.trim_end())
                };
                set_line(
                    &mut out,
                    field.line,
                    format!("{}{joined}{}", before(line, open + 1), from(line, close)),
                );
            }
        }
        out.concat()
    }

    /// The text with a new field `name` holding `entry`, at the end of the item.
    fn insert_field(&self, item: &Item, name: &str, entry: &str) -> String {
        let mut out: Vec<String> = self.lines.iter().map(|l| (*l).to_owned()).collect();
        let pad = " ".repeat(item.key_indent);
        insert_lines(&mut out, item.end, &[format!("{pad}{name}:"), format!("{pad}  - {entry}")]);
        out.concat()
    }

    /// The text without the entries of `field` for which `matches` holds (the field goes too when
    /// it has none left).
    fn remove(&self, field: &Field, matches: impl Fn(&str) -> bool) -> Result<String, String> {
        let mut out: Vec<String> = self.lines.iter().map(|l| (*l).to_owned()).collect();
        match &field.list {
            List::Block { indent, entries } => {
                let gone: Vec<&(usize, usize)> = entries
                    .iter()
                    .filter(|&&(s, e)| matches(&self.dedented(s, e, *indent).replacen('-', " ", 1)))
                    .collect();
                let [&(start, end)] = gone.as_slice() else {
                    return Err("the key's entry was not found in the text".to_owned());
                };
                let (start, end) = if entries.len() == 1 { (field.line, end) } else { (start, end) };
                out.drain(start.min(out.len())..end.min(out.len()));
            }
            List::Flow => {
                let line = self.line(field.line);
                let (open, close) = flow_bounds(line);
                let parts = split_flow(line.get(open + 1..close).unwrap_or_default());
                let kept: Vec<&str> = parts.iter().copied().filter(|p| !matches(p)).collect();
                if kept.len() + 1 != parts.len() {
                    return Err("the key's entry was not found in the text".to_owned());
                }
                if kept.is_empty() {
                    out.drain(field.line.min(out.len())..(field.line + 1).min(out.len()));
                } else {
                    let joined: Vec<&str> = kept.iter().map(|p| p.trim()).collect();
                    let text =
                        format!("{}{}{}", before(line, open + 1), joined.join(", "), from(line, close));
                    set_line(&mut out, field.line, text);
                }
            }
        }
        Ok(out.concat())
    }

    fn line(&self, i: usize) -> &'a str {
        self.lines.get(i).copied().unwrap_or_default()
    }

    /// The block sequence under the line `parent` (whose key sits at column `parent_indent`):
    /// the column of its dashes, and each item's lines (`end` past its last content line).
    fn block_items(&self, parent: usize, parent_indent: usize) -> (usize, Vec<(usize, usize)>) {
        let mut items: Vec<(usize, usize)> = Vec::new();
        let mut indent = None;
        for i in parent + 1..self.lines.len() {
            let line = self.line(i);
            if !is_content(line) {
                continue;
            }
            let at = indent_of(line);
            let dash = line.trim_start().starts_with("- ") || line.trim() == "-";
            let seq = *indent.get_or_insert(at);
            if at < seq || at < parent_indent || (at == seq && !dash) || (items.is_empty() && !dash) {
                break;
            }
            if at == seq {
                items.push((i, i + 1));
            } else if let Some(last) = items.last_mut() {
                last.1 = i + 1;
            }
        }
        (indent.unwrap_or(parent_indent + 2), items)
    }

    /// Lines `start..end` with `indent` columns taken off each (less from a line with fewer).
    fn dedented(&self, start: usize, end: usize, indent: usize) -> String {
        (start..end).map(|i| self.line(i)).map(|l| from(l, indent_of(l).min(indent))).collect()
    }
}

fn insert_lines(out: &mut Vec<String>, at: usize, new: &[String]) {
    let at = at.min(out.len());
    if let Some(prev) = at.checked_sub(1).and_then(|p| out.get_mut(p)) {
        if !prev.ends_with('\n') {
            prev.push('\n');
        }
    }
    for (k, line) in new.iter().enumerate() {
        out.insert(at + k, format!("{line}\n"));
    }
}

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start_matches(' ').len()
}

/// A line with something besides spaces and a comment.
fn is_content(line: &str) -> bool {
    let t = line.trim();
    !t.is_empty() && !t.starts_with('#')
}

/// What follows `key` on its line, without a trailing comment, trimmed.
fn value_text<'l>(line: &'l str, key: &str) -> &'l str {
    let rest = line.trim_start().strip_prefix("- ").unwrap_or(line.trim_start());
    let rest = rest.trim_start().strip_prefix(key).unwrap_or_default();
    strip_comment(rest).trim()
}

/// `s` before a ` #` comment outside quotes.
fn strip_comment(s: &str) -> &str {
    let mut quote = None;
    let mut prev = ' ';
    for (i, c) in s.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if prev == ' ' || prev == '\t' => return before(s, i),
            _ => {}
        }
        prev = c;
    }
    s
}

/// The byte positions of a one-line flow sequence's `[` and its `]`.
fn flow_bounds(line: &str) -> (usize, usize) {
    let value = strip_comment(line);
    let open = value.find('[').unwrap_or(0);
    let close = value.rfind(']').unwrap_or(value.len());
    (open, close)
}

/// The entries of a flow sequence's inside, split at its top-level commas.
fn split_flow(inner: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut quote, mut start) = (0i32, None, 0);
    for (i, c) in inner.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '{' | '[') => depth += 1,
            (None, '}' | ']') => depth -= 1,
            (None, ',') if depth == 0 => {
                parts.push(inner.get(start..i).unwrap_or_default());
                start = i + 1;
            }
            _ => {}
        }
    }
    let last = from(inner, start);
    if !last.trim().is_empty() {
        parts.push(last);
    }
    parts
}

/// `s` up to byte `i` (all of it when `i` is past its end).
fn before(s: &str, i: usize) -> &str {
    s.get(..i).unwrap_or(s)
}

/// `s` from byte `i` (nothing when `i` is past its end).
fn from(s: &str, i: usize) -> &str {
    s.get(i..).unwrap_or_default()
}

fn set_line(out: &mut [String], i: usize, text: String) {
    if let Some(slot) = out.get_mut(i) {
        *slot = text;
    }
}
