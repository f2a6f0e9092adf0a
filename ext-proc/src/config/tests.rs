//! The config's parse and validation, field by field.
use super::pools::*;
use super::redis::*;
use super::*;

const BASE: &str = "listen: 127.0.0.1:0\nredis: {url: 'redis://127.0.0.1:6379'}\n";

fn err(yaml: &str) -> String {
    let mut config = match Config::from_yaml(yaml) {
        Ok(c) => c,
        Err(e) => return e.to_string(),
    };
    config.read_secrets().unwrap_err().to_string()
}

fn load_yaml(yaml: &str) -> Config {
    let mut config = Config::from_yaml(yaml).unwrap();
    config.read_secrets().unwrap();
    config
}

#[test]
fn accepts_a_full_config() {
    let c = Config::from_yaml(&format!(
        "{BASE}tenants:\n  - id: acme\n    limits: {{requests_per_minute: 60, tokens_per_minute: 1000, token_burst: 2000}}\n"
    ))
    .unwrap();
    assert_eq!(c.tenant("acme").unwrap().limits.token_burst, Some(2000));
    assert_eq!(c.redis.command_timeout_ms, 25);
    assert_eq!(c.usage_stream(), "llmgw:usage-events");
}

#[test]
fn models_with_tokenizers() {
    let c = Config::from_yaml(&format!(
        "{BASE}tenants: []\nmodels:\n  - name: qwen\n    max_model_len: 32768\n    tokenizer: {{huggingface: /m/tokenizer.json}}\n    chat_template: {{tokenizer_config: /m/tokenizer_config.json}}\n  - name: gpt\n    max_model_len: 8192\n    tokenizer: {{tiktoken: {{ranks: cl100k_base}}}}\n"
    ))
    .unwrap();
    assert_eq!(c.models.len(), 2);
    assert!(c.models[1].chat_template.is_none());
    assert_eq!(c.context.count_timeout_ms, 300);
    assert_eq!(c.shutdown_grace_ms, 10_000);
}

#[test]
fn model_errors_name_the_field() {
    let model = |body: &str| err(&format!("{BASE}tenants: []\nmodels:\n  - {body}\n"));
    assert_eq!(
        model("{name: '', max_model_len: 1, tokenizer: {tiktoken: {ranks: cl100k_base}}}"),
        "models[0].name: must be non-empty"
    );
    assert_eq!(
        model("{name: a, max_model_len: 0, tokenizer: {tiktoken: {ranks: cl100k_base}}}"),
        "models[0].max_model_len: must be > 0"
    );
    assert_eq!(
        model("{name: a, max_model_len: 1, tokenizer: {}}"),
        "models[0].tokenizer: exactly one of `huggingface`, `tiktoken` and `tekken` must be set"
    );
    assert_eq!(
        model("{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: /x.tiktoken}}}"),
        "models[0].tokenizer.tiktoken.pattern: required with a ranks file"
    );
    assert_eq!(
        model("{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: o200k_base, special_tokens: ['<x>']}}}"),
        "models[0].tokenizer.tiktoken.special_tokens: not allowed with a builtin encoding (it has its own)"
    );
    assert_eq!(
        model("{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: /r, pattern: p, special_tokens: ['<x>', '<x>']}}}"),
        "models[0].tokenizer.tiktoken.special_tokens[1]: duplicate special token \"<x>\""
    );
    assert_eq!(
        model("{name: a, max_model_len: 1, tokenizer: {tekken: /t.json}, chat_template: {bos_token: '<s>'}}"),
        "models[0].chat_template: at least one of `tokenizer_config` and `jinja` must be set"
    );
    let e = model("{name: a, max_model_len: 1, tokenizer: {tekken: /t.json, hf: 1}}");
    assert!(e.contains("unknown field `hf`"), "{e}");
    let e =
        model("{name: a, max_model_len: 1, tokenizer: {tiktoken: {ranks: cl100k_base, normalization: nfd}}}");
    assert!(e.contains("unknown variant `nfd`"), "{e}");
    let two = err(&format!(
        "{BASE}tenants: []\nmodels:\n  - {{name: a, max_model_len: 1, tokenizer: {{tekken: /t}}}}\n  - {{name: a, max_model_len: 1, tokenizer: {{tekken: /t}}}}\n"
    ));
    assert_eq!(two, "models[1].name: duplicate model 'a'");
    assert_eq!(
        err(&format!("{BASE}tenants: []\ncontext: {{count_timeout_ms: 0}}\n")),
        "context.count_timeout_ms: must be > 0"
    );
    assert_eq!(
        err(&format!("{BASE}tenants: []\ncontext: {{max_counts_per_tenant: 0}}\n")),
        "context.max_counts_per_tenant: must be > 0"
    );
    assert_eq!(
        err(&format!("{BASE}tenants: []\nshutdown_grace_ms: 0\n")),
        "shutdown_grace_ms: must be in 1..=600000"
    );
    assert_eq!(
        err(&format!("{BASE}tenants: []\nshutdown_grace_ms: 600001\n")),
        "shutdown_grace_ms: must be in 1..=600000"
    );
}

#[test]
fn reservations_are_validated_and_named() {
    let c = Config::from_yaml(&format!("{BASE}tenants: []\n")).unwrap();
    assert_eq!(
        c.metering.reservations,
        ReservationsConfig { record_after_ms: 3_900_000, sweep_interval_ms: 5_000, sweep_batch: 100 }
    );
    let r = |yaml: &str| err(&format!("{BASE}tenants: []\nmetering: {{reservations: {yaml}}}\n"));
    assert_eq!(
        r("{record_after_ms: 999}"),
        "metering.reservations.record_after_ms: must be in 1000..=604800000"
    );
    assert_eq!(
        r("{record_after_ms: 604800001}"),
        "metering.reservations.record_after_ms: must be in 1000..=604800000"
    );
    assert_eq!(
        r("{sweep_interval_ms: 99}"),
        "metering.reservations.sweep_interval_ms: must be in 100..=600000"
    );
    assert_eq!(r("{sweep_batch: 0}"), "metering.reservations.sweep_batch: must be in 1..=10000");
    assert_eq!(r("{sweep_batch: 10001}"), "metering.reservations.sweep_batch: must be in 1..=10000");
    let e = r("{after_ms: 1}");
    assert!(e.contains("unknown field `after_ms`"), "{e}");
    let c = Config::from_yaml(&format!(
        "{BASE}tenants: []\nmetering: {{reservations: {{record_after_ms: 1000, sweep_interval_ms: 100}}}}\n"
    ))
    .unwrap();
    assert_eq!((c.metering.reservations.record_after_ms, c.metering.reservations.sweep_batch), (1000, 100));
}

#[test]
fn unknown_field_is_named() {
    let e = err(&format!("{BASE}tenants: []\nbogus: 1\n"));
    assert!(e.contains("unknown field `bogus`"), "{e}");
}

#[test]
fn unknown_limit_field_is_named() {
    let e = err(&format!("{BASE}tenants:\n  - id: a\n    limits: {{rpm: 1}}\n"));
    assert!(e.contains("unknown field `rpm`"), "{e}");
}

#[test]
fn zero_rate() {
    assert_eq!(
        err(&format!("{BASE}tenants:\n  - id: a\n    limits: {{requests_per_minute: 0}}\n")),
        "tenants[0].limits.requests_per_minute: must be > 0 (omit it for no limit)"
    );
}

#[test]
fn burst_without_rate() {
    assert_eq!(
        err(&format!("{BASE}tenants:\n  - id: a\n    limits: {{token_burst: 5}}\n")),
        "tenants[0].limits.token_burst: needs tokens_per_minute"
    );
}

#[test]
fn zero_burst() {
    assert_eq!(
        err(&format!(
            "{BASE}tenants:\n  - id: a\n    limits: {{requests_per_minute: 5, request_burst: 0}}\n"
        )),
        "tenants[0].limits.request_burst: must be > 0"
    );
}

#[test]
fn duplicate_tenant() {
    assert_eq!(
        err(&format!("{BASE}tenants:\n  - {{id: a, limits: {{}}}}\n  - {{id: a, limits: {{}}}}\n")),
        "tenants[1].id: duplicate tenant 'a'"
    );
}

#[test]
fn bad_tenant_id() {
    assert_eq!(
        err(&format!("{BASE}tenants:\n  - {{id: 'a{{b}}', limits: {{}}}}\n")),
        "tenants[0].id: must be non-empty letters, digits, '.', '_' or '-'"
    );
}

#[test]
fn redis_needs_exactly_one_target() {
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {}\ntenants: []\n"),
        "redis: one of url or cluster_urls is required"
    );
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', cluster_urls: ['redis://y']}\ntenants: []\n"),
        "redis: set either url or cluster_urls, not both"
    );
}

#[test]
fn zero_timeout() {
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', command_timeout_ms: 0}\ntenants: []\n"),
        "redis.command_timeout_ms: must be > 0"
    );
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', local_share: 0}\ntenants: []\n"),
        "redis.local_share: must be in (0, 1]"
    );
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', lease_fraction: 0.6}\ntenants: []\n"),
        "redis.lease_fraction: must be in [0, 0.5]"
    );
}

const POOL: &str = "listen: 127.0.0.1:0\nredis: {url: 'redis://x'}\ntenants: []\npools:\n";

#[test]
fn pool_needs_a_threshold() {
    assert_eq!(
        err(&format!("{POOL}  - {{name: a, endpoints: ['http://127.0.0.1:1']}}\n")),
        "pools[0]: set at least one of max_queue_depth, max_kv_cache_usage, max_in_flight"
    );
}

#[test]
fn scraped_threshold_needs_endpoints() {
    assert_eq!(
        err(&format!("{POOL}  - {{name: a, max_queue_depth: 4}}\n")),
        "pools[0].endpoints: needed to scrape max_queue_depth / max_kv_cache_usage"
    );
}

#[test]
fn kv_cache_usage_is_a_fraction() {
    assert_eq!(
        err(&format!("{POOL}  - {{name: a, endpoints: ['http://h:1'], max_kv_cache_usage: 95}}\n")),
        "pools[0].max_kv_cache_usage: must be in (0, 1]"
    );
}

#[test]
fn endpoint_must_be_http() {
    assert_eq!(
        err(&format!("{POOL}  - {{name: a, endpoints: ['h:1'], max_queue_depth: 1}}\n")),
        "pools[0].endpoints[0]: must be an http:// URL"
    );
}

#[test]
fn picker_defaults_and_errors() {
    let ok = |picker: &str| {
        Config::from_yaml(&format!(
            "{POOL}  - {{name: a, endpoints: ['http://10.0.0.1:8000/', 'http://[::1]:9'], picker: {picker}}}\n"
        ))
        .unwrap()
        .pools[0]
        .picker
        .unwrap()
    };
    let p = ok("{}");
    assert_eq!(
        (p.prefix_weight, p.queue_weight, p.kv_cache_weight, p.in_flight_weight),
        (3.0, 2.0, 2.0, 2.0)
    );
    assert_eq!((p.affinity_load_factor, p.prefix_lru_blocks, p.fallback_endpoints), (2.0, 16_384, 1));
    assert_eq!((p.stale_after_ms, p.stale_after_ms(500), p.stale_after_ms(5_000)), (None, 2_000, 15_000));
    assert_eq!(ok("{stale_after_ms: 501}").stale_after_ms(500), 501);
    assert!(!p.admission_leases && ok("{admission_leases: true}").admission_leases);
    let leases = |picker: &str| {
        Config::from_yaml(&format!(
            "{POOL}  - {{name: a, endpoints: ['http://10.0.0.1:8000'], {picker}}}\n  - {{name: b, max_in_flight: 4}}\n"
        ))
        .unwrap()
    };
    let c = leases("picker: {}");
    assert!(!c.pool_allows_admission_leases("a"), "a picking pool gets no leases by default");
    assert!(c.pool_allows_admission_leases("b"), "a pool shed by its load does, within its headroom");
    assert_eq!(c.load_protected_pool("b").map(|p| p.name.as_str()), Some("b"));
    assert!(c.load_protected_pool("a").is_none() && c.load_protected_pool("unknown").is_none());
    assert_eq!(c.lease_level(&c.pools[1]), 1.0, "no tier levels: shed at 1.0");
    assert!(c.pool_allows_admission_leases("unknown"), "a pool the sidecar does not watch may");
    assert!(leases("picker: {admission_leases: true}").pool_allows_admission_leases("a"));
    assert!(!leases("picker: {admission_leases: true}, admission_leases: false")
        .pool_allows_admission_leases("a"));
    let opted =
        Config::from_yaml(&format!("{POOL}  - {{name: b, max_in_flight: 4, admission_leases: true}}\n"))
            .unwrap();
    assert!(opted.pool_allows_admission_leases("b"));
    let out =
        Config::from_yaml(&format!("{POOL}  - {{name: b, max_in_flight: 4, admission_leases: false}}\n"))
            .unwrap();
    assert!(!out.pool_allows_admission_leases("b"), "the pool's own setting wins");
    let bad = |picker: &str| {
        err(&format!("{POOL}  - {{name: a, endpoints: ['http://10.0.0.1:8000'], picker: {picker}}}\n"))
    };
    assert_eq!(bad("{queue_weight: -1}"), "pools[0].picker.queue_weight: must be a finite number >= 0");
    assert_eq!(bad("{prefix_weight: .nan}"), "pools[0].picker.prefix_weight: must be a finite number >= 0");
    assert_eq!(
        bad("{affinity_load_factor: 0.5}"),
        "pools[0].picker.affinity_load_factor: must be a finite number >= 1"
    );
    assert_eq!((p.home_load_factor, ok("{home_load_factor: 1.5}").home_load_factor), (0.0, 1.5));
    for v in ["0.5", ".inf", "-1"] {
        assert_eq!(
            bad(&format!("{{home_load_factor: {v}}}")),
            "pools[0].picker.home_load_factor: must be 0 (off) or a finite number >= 1"
        );
    }
    assert_eq!(bad("{prefix_lru_blocks: 0}"), "pools[0].picker.prefix_lru_blocks: must be in 1..=10000000");
    assert_eq!(bad("{fallback_endpoints: 17}"), "pools[0].picker.fallback_endpoints: must be at most 16");
    assert_eq!((p.slot_overcommit, ok("{slot_overcommit: 0}").slot_overcommit), (2, 0));
    assert_eq!(bad("{slot_overcommit: 65}"), "pools[0].picker.slot_overcommit: must be at most 64");
    assert!(bad("{slot_overcommit: -1}").contains("slot_overcommit"));
    assert_eq!(
        bad("{stale_after_ms: 500}"),
        "pools[0].picker.stale_after_ms: must be > scrape_interval_ms (500)"
    );
    assert!(bad("{queue_weigth: 1}").contains("unknown field `queue_weigth`"));
    assert_eq!(
        err(&format!("{POOL}  - {{name: a, endpoints: ['http://vllm-0:8000'], picker: {{}}}}\n")),
        "pools[0].endpoints[0]: the picker needs http://ip:port (an IP address and a port, no path)"
    );
    assert_eq!(
        err(&format!("{POOL}  - {{name: a, picker: {{}}}}\n")),
        "pools[0].endpoints: needed by picker"
    );
}

#[test]
fn duplicate_pool() {
    assert_eq!(
        err(&format!("{POOL}  - {{name: a, max_in_flight: 1}}\n  - {{name: a, max_in_flight: 1}}\n")),
        "pools[1].name: duplicate pool 'a'"
    );
}

#[test]
fn flow_control() {
    let tenants = "tenants:\n  - {id: heavy, limits: {}}\n";
    let pool = |flow: &str| {
        format!(
            "pools:\n  - {{name: p, endpoints: ['http://h:1'], max_in_flight: 8, flow_control: {flow}}}\n"
        )
    };
    let tiers = "flow_control: {tiers: [{name: premium, max_queue_wait_ms: 500}, {name: batch, max_queue_wait_ms: 5000}], tenant_weights: {heavy: 2}}\n";
    let c = load_yaml(&format!("{BASE}{tenants}{}{tiers}", pool("{}")));
    let flow = c.flow_control.as_ref().unwrap();
    assert_eq!(flow.output_token_weight, 2.0);
    assert_eq!(flow.tiers[1].max_queue_wait_ms, 5000);
    assert_eq!(
        c.pools[0].flow_control,
        Some(PoolFlowConfig {
            max_queued: 1000,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            leases_below_load: 0.8
        })
    );
    for (yaml, expected) in [
        (format!("{BASE}{tenants}{}", pool("{}")), "pools[0].flow_control: needs the top-level flow_control"),
        (format!("{BASE}{tenants}{}{tiers}", pool("{max_queued: 0}")), "pools[0].flow_control.max_queued: must be in"),
        (
            format!("{BASE}{tenants}{}{tiers}", pool("{max_queued_bytes: 1000}")),
            "pools[0].flow_control.max_queued_bytes: must be in 1048576..=68719476736",
        ),
        (format!("{BASE}{tenants}{}{tiers}", pool("{leases_below_load: 1.5}")), "pools[0].flow_control.leases_below_load"),
        (
            format!("{BASE}{tenants}pools:\n  - {{name: p, endpoints: ['http://h:1'], flow_control: {{}}}}\n{tiers}"),
            "pools[0].flow_control: needs the pool's max_in_flight",
        ),
        (format!("{BASE}{tenants}flow_control: {{tiers: []}}\n"), "flow_control.tiers: must list at least one tier"),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}, {{name: a, max_queue_wait_ms: 1}}]}}\n"),
            "flow_control.tiers[1].name: duplicate tier 'a'",
        ),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 0}}]}}\n"),
            "flow_control.tiers[0].max_queue_wait_ms: must be in 1..=600000",
        ),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], tenant_weights: {{ghost: 1}}}}\n"),
            "flow_control.tenant_weights.ghost: is not a tenant",
        ),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], tenant_weights: {{heavy: 0}}}}\n"),
            "flow_control.tenant_weights.heavy: must be in (0, 1000]",
        ),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], output_token_weight: -1}}\n"),
            "flow_control.output_token_weight: must be in 0..=100",
        ),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1}}], newcomer_reserve: 0.6}}\n"),
            "flow_control.newcomer_reserve: must be in 0..=0.5",
        ),
        (format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_wait: 1}}]}}\n"), "unknown field `max_wait`"),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1, max_load: 0.5}}, {{name: b, max_queue_wait_ms: 1}}]}}\n"),
            "flow_control.tiers[1].max_load: must not be above the higher tier's",
        ),
        (
            format!("{BASE}{tenants}flow_control: {{tiers: [{{name: a, max_queue_wait_ms: 1, max_load: 0}}]}}\n"),
            "flow_control.tiers[0].max_load: must be in (0, 1]",
        ),
    ] {
        let e = err(&yaml);
        assert!(e.contains(expected), "{yaml}\n=> {e}");
    }
}

#[test]
fn tier_level_range() {
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'redis://x'}\ntenants: []\nshedding: {tier_levels: {batch: 0}}\n"),
        "shedding.tier_levels.batch: must be in (0, 1]"
    );
}

#[test]
fn model_limits_are_validated() {
    assert_eq!(
        err(&format!(
            "{BASE}tenants:\n  - id: a\n    limits: {{}}\n    model_limits: {{m1: {{tokens_per_minute: 0}}}}\n"
        )),
        "tenants[0].model_limits.m1.tokens_per_minute: must be > 0 (omit it for no limit)"
    );
}

#[test]
fn key_limits_are_read_and_validated() {
    let tenant = |keys: &str| format!("{BASE}tenants:\n  - id: a\n    limits: {{}}\n    api_keys: {keys}\n");
    let c = load_yaml(&tenant("[{name: ci-2026, limits: {requests_per_minute: 2}}]"));
    let t = c.tenant("a").unwrap();
    assert_eq!(t.key_limits("ci-2026").and_then(|l| l.requests_per_minute), Some(2));
    assert!(t.key_limits("other").is_none());
    assert_eq!(
        err(&tenant("[{name: ci, limits: {tokens_per_minute: 0}}]")),
        "tenants[0].api_keys[0].limits.tokens_per_minute: must be > 0 (omit it for no limit)"
    );
    assert_eq!(
        err(&tenant("[{name: 'sha256:abc', limits: {}}]")),
        "tenants[0].api_keys[0].name: must be non-empty letters, digits, '.', '_' or '-'"
    );
    assert_eq!(
        err(&tenant("[{name: ci, limits: {}}, {name: ci, limits: {}}]")),
        "tenants[0].api_keys[1].name: duplicate key 'ci'"
    );
}

#[test]
fn breaker_threshold() {
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'redis://x', breaker: {failure_threshold: 0}}\ntenants: []\n"),
        "redis.breaker.failure_threshold: must be > 0"
    );
}

#[test]
fn tier_failure_modes() {
    let c = Config::from_yaml(
        "listen: 127.0.0.1:0\nredis: {url: 'redis://x', failure_mode: closed, tier_failure_modes: {premium: open}}\ntenants: []\n",
    )
    .unwrap();
    assert_eq!(c.redis.failure_mode("premium"), FailureMode::Open);
    assert_eq!(c.redis.failure_mode("free"), FailureMode::Closed);
}

#[test]
fn redis_urls_never_carry_credentials() {
    for url in [
        "redis://:hunter2@h:6379",
        "rediss://llmgw:hunter2@h:6380/0",
        "redis://llmgw@h",
        "redis://h:6379/0?pass=hunter2",
    ] {
        let e = err(&format!("listen: 127.0.0.1:0\nredis: {{url: '{url}'}}\ntenants: []\n"));
        assert!(e.starts_with("redis.url: must not carry credentials"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }
    let e = err("listen: 127.0.0.1:0\nredis: {cluster_urls: ['rediss://a:1', 'rediss://u:hunter2@b:1']}\ntenants: []\n");
    assert!(e.starts_with("redis.cluster_urls[1]: must not carry credentials"), "{e}");
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'rediss://h:1/#insecure'}\ntenants: []\n"),
        "redis.url: a #fragment (e.g. #insecure) is not supported"
    );
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {url: 'http://h:1'}\ntenants: []\n"),
        "redis.url: the scheme must be redis:// or rediss://"
    );
    assert_eq!(
        err("listen: 127.0.0.1:0\nredis: {cluster_urls: ['rediss://a:1', 'redis://b:1']}\ntenants: []\n"),
        "redis.cluster_urls: mixes redis:// and rediss:// URLs"
    );
}

#[test]
fn redis_credentials_and_tls_are_checked() {
    let redis = |body: &str| err(&format!("listen: 127.0.0.1:0\nredis: {{{body}}}\ntenants: []\n"));
    assert_eq!(redis("url: 'redis://h', tls: {ca_file: /ca.pem}"), "redis.tls: needs rediss:// URLs");
    assert_eq!(
        redis("url: 'rediss://h', tls: {cert_file: /c.pem}"),
        "redis.tls: set both cert_file and key_file, or neither"
    );
    assert_eq!(
        redis("url: 'rediss://h', username: llmgw"),
        "redis.username: needs redis.password_file or redis.password_env"
    );
    assert_eq!(
        redis("url: 'rediss://h', password_file: /p, password_env: P"),
        "redis: set at most one of password_file and password_env"
    );
    assert_eq!(
        redis("url: 'rediss://h', password_env: GATEWAY_TEST_SURELY_UNSET_VAR"),
        "redis.password_env: environment variable GATEWAY_TEST_SURELY_UNSET_VAR is not set (or not UTF-8)"
    );
    let e = redis("url: 'rediss://h', tls: {ca_file: /nonexistent/ca.pem}");
    assert!(e.starts_with("redis.tls.ca_file: /nonexistent/ca.pem: "), "{e}");
    let e = redis("url: 'redis://h', password_file: /nonexistent/pw");
    assert!(e.starts_with("redis.password_file: /nonexistent/pw: "), "{e}");
}

#[test]
fn a_password_file_is_read_and_never_printed() {
    let dir = std::env::temp_dir().join(format!("gw-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pw = dir.join("pw");
    std::fs::write(&pw, "s3cret-Pa55\n").unwrap();
    let c = load_yaml(&format!(
        "listen: 127.0.0.1:0\nredis: {{url: 'redis://h', username: llmgw, password_file: '{}'}}\ntenants: []\n",
        pw.display()
    ));
    assert_eq!(c.redis.secrets.password.as_ref().unwrap().expose(), "s3cret-Pa55");
    assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
    std::fs::write(&pw, "\n").unwrap();
    let e = err(&format!(
        "listen: 127.0.0.1:0\nredis: {{url: 'redis://h', password_file: '{}'}}\ntenants: []\n",
        pw.display()
    ));
    assert_eq!(e, "redis.password_file: the password is empty");
    let notpem = dir.join("not.pem");
    std::fs::write(&notpem, "hello").unwrap();
    let e = err(&format!(
        "listen: 127.0.0.1:0\ntls: {{cert_file: '{0}', key_file: '{0}', client_ca_file: '{0}'}}\nredis: {{url: 'redis://h'}}\ntenants: []\n",
        notpem.display()
    ));
    assert!(e.starts_with("tls.cert_file: ") && e.ends_with("no PEM certificate in it"), "{e}");
    let e = err("listen: 127.0.0.1:0
tls: {cert_file: /c}
redis: {url: 'redis://h'}
tenants: []
");
    assert!(e.contains("missing field `key_file`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_listen_address() {
    let e = err("listen: nowhere\nredis: {url: 'redis://x'}\ntenants: []\n");
    assert!(e.contains("listen"), "{e}");
}

#[test]
fn flow_control_without_a_pool_of_its_own_is_reported_unused() {
    let tiers = "flow_control: {tiers: [{name: standard, max_queue_wait_ms: 1000}]}\n";
    let pool = |extra: &str| {
        format!("pools:\n  - {{name: p, endpoints: ['http://10.0.0.1:1'], max_in_flight: 8{extra}}}\n")
    };
    let unused = Config::from_yaml(&format!("{BASE}tenants: []\n{tiers}{}", pool(""))).unwrap();
    assert!(unused.flow_control_unused());
    let used =
        Config::from_yaml(&format!("{BASE}tenants: []\n{tiers}{}", pool(", flow_control: {}"))).unwrap();
    assert!(!used.flow_control_unused());
    let none = Config::from_yaml(&format!("{BASE}tenants: []\n{}", pool(""))).unwrap();
    assert!(!none.flow_control_unused());
}
