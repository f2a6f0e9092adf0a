//! Upgrades with no request lost, as rendered for the standalone target: the sidecar replicas
//! (one config per replica, one health-checked endpoint each, the admission's retry policy) and
//! Envoy's hot restart (its command line, the restarter and the systemd unit).

// Test helpers outside #[test] fns are not covered by clippy.toml's allow-*-in-tests settings.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::BTreeMap;

use gatewayctl::config::Loaded;
use gatewayctl::render::{render, Target};
use serde_yaml_ng::Value;

const EXAMPLE: &str = "../envoy/examples/gateway.yaml";

/// The example (whose sidecar has `metrics_listen: 127.0.0.1:9464`) with `sidecar` and `envoy`
/// added at the top of those sections, rendered for the standalone target.
fn rendered(name: &str, sidecar: &str, envoy: &str) -> (BTreeMap<String, String>, Vec<String>) {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    assert!(text.contains("\nsidecar:\n") && text.contains("\nenvoy:\n"), "the example's sections moved");
    let text = text.replacen("\nsidecar:\n", &format!("\nsidecar:\n{sidecar}"), 1).replacen(
        "\nenvoy:\n",
        &format!("\nenvoy:\n{envoy}"),
        1,
    );
    let dir = std::env::temp_dir().join(format!("gatewayctl-upgrades-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, text).unwrap();
    let loaded = Loaded::load(&path).unwrap();
    let output = render(&loaded, Target::Standalone).unwrap();
    (output.files.into_iter().map(|f| (f.path, f.content)).collect(), output.notes)
}

fn yaml(text: &str) -> Value {
    serde_yaml_ng::from_str(text).unwrap()
}

fn ext_proc_cluster(files: &BTreeMap<String, String>) -> Value {
    let b = yaml(&files["standalone/envoy.yaml"]);
    let clusters = b["static_resources"]["clusters"].as_sequence().unwrap().clone();
    clusters.into_iter().find(|c| c["name"] == "llm_gateway_ext_proc").unwrap()
}

#[test]
fn three_replicas_get_a_file_and_a_health_checked_endpoint_each() {
    let (files, notes) = rendered("replicas", "  replicas: 3\n", "");
    let listens: Vec<(String, String)> = ["sidecar.yaml", "sidecar-1.yaml", "sidecar-2.yaml"]
        .iter()
        .map(|name| {
            let text = &files[&format!("standalone/{name}")];
            let parsed = gateway_ext_proc::config::Config::from_yaml(text).unwrap();
            (parsed.listen.to_string(), parsed.metrics_listen.unwrap().to_string())
        })
        .collect();
    let expected: Vec<(String, String)> =
        (0..3).map(|k| (format!("127.0.0.1:{}", 50051 + k), format!("127.0.0.1:{}", 9464 + k))).collect();
    assert_eq!(listens, expected);
    assert!(!files.contains_key("standalone/sidecar-3.yaml"));
    let cluster = ext_proc_cluster(&files);
    let ports: Vec<u64> = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| e["endpoint"]["address"]["socket_address"]["port_value"].as_u64().unwrap())
        .collect();
    assert_eq!(ports, [50051, 50052, 50053]);
    let check = &cluster["health_checks"][0];
    assert_eq!(check["interval"], "1s");
    assert_eq!(check["no_traffic_interval"], "1s");
    assert_eq!(check["unhealthy_threshold"], 1);
    assert!(check["grpc_health_check"].is_mapping());
    assert_eq!(cluster["lb_policy"], "LEAST_REQUEST");
    assert_eq!(cluster["circuit_breakers"]["thresholds"][0]["max_retries"], 65536);
    assert!(notes.iter().any(|n| n.contains("3 sidecar replicas")), "{notes:?}");
}

#[test]
fn the_admission_is_retried_on_another_replica() {
    let (files, _) = rendered("retry", "  replicas: 2\n", "");
    let b = yaml(&files["standalone/envoy.yaml"]);
    let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    // The admission sits in the lease matcher (the example leases): found by its member's name.
    let filters: serde_json::Value = serde_json::to_value(&hcm["http_filters"]).unwrap();
    let policy = find_key(&filters, "retry_policy").expect("the admission's grpc_service has a retry_policy");
    assert_eq!(policy["retry_on"], "connect-failure,refused-stream,reset,unavailable");
    assert_eq!(policy["num_retries"], 4);
    assert_eq!(policy["retry_host_predicate"][0]["name"], "envoy.retry_host_predicates.previous_hosts");
}

fn find_key(v: &serde_json::Value, key: &str) -> Option<serde_json::Value> {
    match v {
        serde_json::Value::Object(m) => {
            m.get(key).cloned().or_else(|| m.values().find_map(|x| find_key(x, key)))
        }
        serde_json::Value::Array(a) => a.iter().find_map(|x| find_key(x, key)),
        _ => None,
    }
}

#[test]
fn one_replica_keeps_its_one_file() {
    let (files, notes) = rendered("one", "", "");
    let keys: Vec<&String> = files.keys().collect();
    assert_eq!(keys, ["standalone/envoy.yaml", "standalone/filter.json", "standalone/sidecar.yaml"]);
    assert!(notes.is_empty(), "{notes:?}");
}

#[test]
fn hot_restart_renders_the_epoch_command_the_restarter_and_the_unit() {
    let hot = "  hot_restart: {dir: /opt/gw, envoy_bin: /opt/envoy/bin/envoy, base_id: 7, drain_time_s: 20, \
               parent_shutdown_time_s: 40, concurrency: 4}\n";
    let (files, notes) = rendered("hot", "", hot);
    let start = &files["standalone/start-envoy.sh"];
    assert!(start.starts_with("#!/bin/sh\n"), "{start}");
    let command = start.lines().skip_while(|l| !l.starts_with("exec ")).collect::<Vec<_>>().join(" ");
    for part in [
        "exec \"/opt/envoy/bin/envoy\" -c \"/opt/gw/envoy.yaml\"",
        "--restart-epoch \"${RESTART_EPOCH:?set by hot-restarter.py}\"",
        "--base-id 7",
        "--drain-time-s 20",
        "--parent-shutdown-time-s 40",
        "--concurrency 4",
    ] {
        assert!(command.contains(part), "{part} not in {command}");
    }
    let unit = &files["standalone/llm-gateway-envoy.service"];
    assert!(unit.contains(
        "ExecStart=\"/usr/bin/python3\" \"/opt/gw/hot-restarter.py\" \"/opt/gw/start-envoy.sh\"\n"
    ));
    assert!(unit.contains("ExecReload=/bin/kill -HUP $MAINPID\n"), "{unit}");
    let restarter = &files["standalone/hot-restarter.py"];
    assert!(restarter.starts_with("#!/usr/bin/env python3\n"));
    assert!(restarter.contains("signal.SIGHUP"));
    assert!(notes.iter().any(|n| n.contains("systemctl reload llm-gateway-envoy")), "{notes:?}");
}

#[test]
fn hot_restart_without_concurrency_counts_the_processors() {
    let (files, _) = rendered("nproc", "", "  hot_restart: {}\n");
    assert!(files["standalone/start-envoy.sh"].contains("--concurrency \"$(nproc)\""));
    assert!(files["standalone/start-envoy.sh"].contains("-c \"/etc/llm-gateway/standalone/envoy.yaml\""));
}
