//! `gatewayctl keys add | revoke | list` on a commented config (`tests/fixtures/keys/gateway.yaml`):
//! what each edit changes in the text (only the key's lines), that the result loads with the
//! strict loader and holds the change, and what is refused.

// Test helpers outside #[test] fns are not covered by clippy.toml's allow-*-in-tests settings.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::path::Path;

use gatewayctl::config::Loaded;
use gatewayctl::key_edit::{add, format_rows, list, revoke, write_atomically, NewKey};

const FILE: &str = "tests/fixtures/keys/gateway.yaml";
const DIGEST: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
/// 2026-03-01T00:00:00Z.
const MARCH_1: u64 = 1_772_323_200;

fn fixture() -> String {
    std::fs::read_to_string(FILE).unwrap()
}

fn loaded(text: &str) -> Loaded {
    Loaded::from_yaml(text, FILE, Path::new("tests/fixtures/keys").to_path_buf()).unwrap()
}

fn key(name: &str) -> NewKey {
    NewKey { name: name.into(), ..NewKey::default() }
}

/// The lines of `after` not in `before`, and the lines of `before` not in `after` (in order;
/// every other line is unchanged and in place).
fn diff(before: &str, after: &str) -> (Vec<String>, Vec<String>) {
    let b: Vec<&str> = before.lines().collect();
    let a: Vec<&str> = after.lines().collect();
    let common_head = b.iter().zip(&a).take_while(|(x, y)| x == y).count();
    let common_tail =
        b[common_head..].iter().rev().zip(a[common_head..].iter().rev()).take_while(|(x, y)| x == y).count();
    let added = a[common_head..a.len() - common_tail].iter().map(|s| (*s).to_owned()).collect();
    let removed = b[common_head..b.len() - common_tail].iter().map(|s| (*s).to_owned()).collect();
    (added, removed)
}

#[test]
fn add_to_a_tenant_without_named_keys_adds_the_field_at_the_end_of_its_entry() {
    let before = fixture();
    let new = NewKey { expires_at: Some("2027-01-01T00:00:00Z".into()), ..key("ci-2026") };
    let after = add(&before, FILE, "acme", &new, DIGEST).unwrap();
    let (added, removed) = diff(&before, &after);
    assert!(removed.is_empty(), "{removed:?}");
    assert_eq!(
        added,
        [
            "    api_keys:".to_owned(),
            format!(
                "      - {{name: \"ci-2026\", sha256: \"{DIGEST}\", expires_at: \"2027-01-01T00:00:00Z\"}}"
            ),
        ]
    );
    // Right after the tenant's last line (its comment kept), before the blank line and the next
    // tenant's comment.
    let at = after.lines().position(|l| l == "    api_keys:").unwrap();
    assert!(after.lines().nth(at - 1).unwrap().ends_with("# shared by all its keys"));
    let keys = loaded(&after).config.tenants[0]
        .keys()
        .into_iter()
        .map(|(n, d, _)| (n, d.to_owned()))
        .collect::<Vec<_>>();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[1], ("ci-2026".to_owned(), DIGEST.to_owned()));
    assert_eq!(keys[0].0, "sha256:2c18b2137a12", "the digest-only key keeps its derived name");
}

#[test]
fn add_to_named_keys_appends_one_line_after_the_last_entry() {
    let before = fixture();
    let new = NewKey { not_before: Some("2026-06-15T00:00:00Z".into()), ..key("q3") };
    let after = add(&before, FILE, "nightly-jobs", &new, DIGEST).unwrap();
    let (added, removed) = diff(&before, &after);
    assert!(removed.is_empty());
    assert_eq!(
        added,
        [format!("      - {{name: \"q3\", sha256: \"{DIGEST}\", not_before: \"2026-06-15T00:00:00Z\"}}")]
    );
    let at = after.lines().position(|l| l.contains("name: \"q3\"")).unwrap();
    assert!(after.lines().nth(at - 1).unwrap().contains("limits: {requests_per_minute: 60}"));
    let names: Vec<String> = loaded(&after).config.tenants[1].keys().into_iter().map(|(n, _, _)| n).collect();
    assert_eq!(names, ["q1", "q2", "q3"]);
}

#[test]
fn add_refuses_a_taken_or_bad_name_bad_times_and_a_digest_in_use() {
    let text = fixture();
    let refused =
        |tenant: &str, new: NewKey, digest: &str| add(&text, FILE, tenant, &new, digest).unwrap_err();
    assert!(refused("nightly-jobs", key("q2"), DIGEST).contains("already has a key named 'q2'"));
    assert!(refused("acme", key("sha256:2c18b2137a12"), DIGEST).contains("--name"));
    assert!(refused("acme", key("a b"), DIGEST).contains("--name: 'a b' must be"));
    assert!(refused("nobody", key("k"), DIGEST).contains("no tenant 'nobody' (tenants: acme, nightly-jobs)"));
    let bad_time = NewKey { expires_at: Some("tomorrow".into()), ..key("k") };
    assert!(refused("acme", bad_time, DIGEST).starts_with("--expires-at: must be an RFC 3339 time in UTC"));
    let inverted = NewKey {
        not_before: Some("2026-07-01T00:00:00Z".into()),
        expires_at: Some("2026-06-01T00:00:00Z".into()),
        ..key("k")
    };
    assert_eq!(
        refused("acme", inverted, DIGEST),
        format!("the edited config does not validate: {FILE}: tenants[0].api_keys[0].expires_at: must be after not_before")
    );
    let taken = "f8c8cb2dce9b1901570893d19c78c76f476ee1342acba217ffda38bd7b490ec2";
    assert!(
        refused("acme", key("k"), taken).contains("duplicate digest (also at tenants[0].api_keys[0].sha256)")
    );
}

#[test]
fn revoke_removes_only_the_keys_lines() {
    let before = fixture();
    // A block-mapping entry, with its comment and limits.
    let after = revoke(&before, FILE, "nightly-jobs", "q2").unwrap();
    let (added, removed) = diff(&before, &after);
    assert!(added.is_empty());
    assert_eq!(removed.len(), 4);
    assert!(removed[0].contains("name: q2") && removed[3].contains("limits"));
    let names: Vec<String> = loaded(&after).config.tenants[1].keys().into_iter().map(|(n, _, _)| n).collect();
    assert_eq!(names, ["q1"]);
    // Its last key is not revoked.
    assert!(revoke(&after, FILE, "nightly-jobs", "q1").unwrap_err().contains("last key"));
    // A one-line entry.
    let after = revoke(&before, FILE, "nightly-jobs", "q1").unwrap();
    let (added, removed) = diff(&before, &after);
    assert!(added.is_empty());
    assert_eq!(removed.len(), 1);
    assert!(removed[0].contains("name: q1"));
}

#[test]
fn rotation_of_a_digest_only_key_adds_a_named_one_then_revokes_the_old_by_its_derived_name() {
    let before = fixture();
    assert!(revoke(&before, FILE, "acme", "sha256:2c18b2137a12").unwrap_err().contains("last key"));
    let with_new = add(&before, FILE, "acme", &key("ci"), DIGEST).unwrap();
    let after = revoke(&with_new, FILE, "acme", "sha256:2c18b2137a12").unwrap();
    let (added, removed) = diff(&with_new, &after);
    assert!(added.is_empty());
    assert_eq!(removed.len(), 1, "the one-line list went with its only digest");
    assert!(removed[0].contains("api_keys_sha256"));
    let names: Vec<String> = loaded(&after).config.tenants[0].keys().into_iter().map(|(n, _, _)| n).collect();
    assert_eq!(names, ["ci"]);
    assert!(revoke(&after, FILE, "acme", "nope")
        .unwrap_err()
        .contains("has no key named 'nope' (its keys: ci)"));
}

#[test]
fn a_tenant_written_as_a_flow_mapping_is_refused_with_what_to_change() {
    let text = fixture().replace(
        "  - id: acme\n    api_keys_sha256: [2c18b2137a12c22896ee08baa63730ebd5642557eda2f63f04c6030323bfd8a8]  # issued 2025\n    tier: standard\n    limits: {requests_per_minute: 600}   # shared by all its keys\n",
        "  - {id: acme, api_keys_sha256: [2c18b2137a12c22896ee08baa63730ebd5642557eda2f63f04c6030323bfd8a8]}\n",
    );
    assert!(text.contains("- {id: acme"));
    let e = add(&text, FILE, "acme", &key("k"), DIGEST).unwrap_err();
    assert!(e.contains("tenants[0] is written as a flow mapping"), "{e}");
}

#[test]
fn list_shows_names_windows_and_digest_prefixes_never_keys() {
    let rows = list(&loaded(&fixture()), "nightly-jobs", MARCH_1).unwrap();
    let table = format_rows(&rows);
    assert_eq!(rows.len(), 2);
    assert_eq!(
        (rows[0].name.as_str(), rows[0].state, rows[0].expires_at.as_str()),
        ("q1", "valid", "2026-04-01T00:00:00Z")
    );
    assert_eq!((rows[1].name.as_str(), rows[1].state, rows[1].own_limits), ("q2", "not yet valid", true));
    assert_eq!(rows[1].digest_prefix, "sha256:4f3d5e1d3c1e");
    assert!(!table.contains("f8c8cb2dce9b1901570893d19c78c76f476ee1342acba217ffda38bd7b490ec2"), "{table}");
    let later = list(&loaded(&fixture()), "nightly-jobs", MARCH_1 + 40 * 86_400).unwrap();
    assert_eq!((later[0].state, later[1].state), ("expired", "valid"));
}

#[test]
fn the_file_is_replaced_whole_and_keeps_its_mode() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = std::env::temp_dir().join(format!("gatewayctl-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, fixture()).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    let edited = add(&fixture(), FILE, "acme", &key("ci"), DIGEST).unwrap();
    write_atomically(&path, &edited).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), edited);
    assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o640);
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary file left: {leftovers:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_example_config_takes_an_add_and_a_revoke() {
    let file = "../envoy/examples/gateway.yaml";
    let before = std::fs::read_to_string(file).unwrap();
    let added = add(&before, file, "acme", &key("acme-2027"), DIGEST).unwrap();
    let (lines, removed) = diff(&before, &added);
    assert!(removed.is_empty() && lines.len() == 1, "{lines:?}");
    let revoked = revoke(&added, file, "acme", "acme-2026").unwrap();
    let (lines, removed) = diff(&added, &revoked);
    assert!(lines.is_empty());
    assert_eq!(removed.len(), 2, "the two-line entry: {removed:?}");
    let text = revoke(&before, file, "nightly-jobs", "sha256:f8c8cb2dce9b").unwrap_err();
    assert!(text.contains("last key"), "{text}");
}

#[test]
fn named_keys_render_into_the_filter_and_the_sidecar() {
    use gatewayctl::render::{render, Target};
    let files: std::collections::BTreeMap<String, String> = render(&loaded(&fixture()), Target::Standalone)
        .unwrap()
        .files
        .into_iter()
        .map(|f| (f.path, f.content))
        .collect();
    let filter: serde_json::Value = serde_json::from_str(&files["standalone/filter.json"]).unwrap();
    let keys = &filter["tenants"][1]["api_keys"];
    assert_eq!(
        (keys[0]["name"].as_str(), keys[0]["expires_at"].as_str()),
        (Some("q1"), Some("2026-04-01T00:00:00Z"))
    );
    assert_eq!(keys[0].get("own_limits"), None);
    assert_eq!(
        (keys[1]["name"].as_str(), keys[1]["own_limits"].as_bool()),
        (Some("q2"), Some(true)),
        "{keys}"
    );
    let parsed =
        gateway_filter::config::Config::from_json(files["standalone/filter.json"].as_bytes()).unwrap();
    let names: Vec<&str> = parsed.api_keys.iter().map(|k| k.name.as_str()).collect();
    assert_eq!(names, ["sha256:2c18b2137a12", "q1", "q2"]);
    let sidecar: serde_yaml_ng::Value = serde_yaml_ng::from_str(&files["standalone/sidecar.yaml"]).unwrap();
    let keys = &sidecar["tenants"][1]["api_keys"];
    assert_eq!(keys[1]["name"].as_str(), Some("q2"));
    assert_eq!(keys[1]["limits"]["requests_per_minute"].as_u64(), Some(60));
    assert!(sidecar["tenants"][0].get("api_keys").is_none(), "a tenant without named keys has none");
}
