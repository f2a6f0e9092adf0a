//! Rendering the example config (envoy/examples/gateway.yaml): the shape of the standalone
//! bootstrap (filters, fallback, health checks, retries, admin on loopback), the components'
//! configs, and the manifests of each target.

// Test helpers outside #[test] fns are not covered by clippy.toml's allow-*-in-tests settings.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

use std::collections::BTreeMap;
use std::path::Path;

use gatewayctl::config::Loaded;
use gatewayctl::render::{render, Target};
use serde_yaml_ng::Value;

const EXAMPLE: &str = "../envoy/examples/gateway.yaml";
/// The example's placeholder digests (`filter.module.sha256`, `kubernetes.sidecar.image_sha256`).
const ZERO_DIGEST: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn files(target: Target) -> BTreeMap<String, String> {
    let loaded = Loaded::load(Path::new(EXAMPLE)).unwrap();
    render(&loaded, target).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect()
}

fn yaml(text: &str) -> Value {
    serde_yaml_ng::from_str(text).unwrap()
}

fn names(list: &Value) -> Vec<&str> {
    list.as_sequence().unwrap().iter().map(|x| x["name"].as_str().unwrap()).collect()
}

#[test]
fn targets_render_their_files() {
    let standalone: Vec<String> = files(Target::Standalone).into_keys().collect();
    assert_eq!(standalone, ["standalone/envoy.yaml", "standalone/filter.json", "standalone/sidecar.yaml"]);
    let istio = files(Target::Istio);
    for f in [
        "istio/envoyfilter.yaml",
        "istio/virtualservice.yaml",
        "istio/destinationrule-pool-qwen.yaml",
        "istio/kustomization.yaml",
        "kubernetes/sidecar-deployment.yaml",
        "kubernetes/sidecar-service.yaml",
        "kubernetes/sidecar-pdb.yaml",
        "kubernetes/sidecar-configmap.yaml",
        "kubernetes/redis-deployment.yaml",
        "kubernetes/kustomization.yaml",
        "kubernetes/sidecar-networkpolicy.yaml",
        "kubernetes/redis-networkpolicy.yaml",
        "istio/sidecar-peerauthentication.yaml",
        "istio/sidecar-authorizationpolicy.yaml",
    ] {
        assert!(istio.contains_key(f), "{f} missing: {:?}", istio.keys());
    }
    assert!(!istio.keys().any(|k| k.starts_with("standalone/") || k.starts_with("envoy-gateway/")));
    let eg = files(Target::EnvoyGateway);
    for f in [
        "envoy-gateway/envoyextensionpolicy.yaml",
        "envoy-gateway/httproute.yaml",
        "envoy-gateway/referencegrant-inference.yaml",
        "envoy-gateway/envoyproxy.yaml",
        "envoy-gateway/envoypatchpolicy.yaml",
    ] {
        assert!(eg.contains_key(f), "{f} missing: {:?}", eg.keys());
    }
    // 22, plus the NetworkPolicies of the sidecar and the trial Redis, the sidecar's Istio
    // PeerAuthentication and AuthorizationPolicy, Envoy Gateway's EnvoyPatchPolicy, and
    // kubernetes/monitoring/'s PodMonitor, PrometheusRule and kustomization.
    assert_eq!(files(Target::All).len(), 30);
}

#[test]
fn standalone_bootstrap_has_the_edge_settings_of_the_config() {
    let dir = tempdir();
    let text = std::fs::read_to_string(EXAMPLE)
        .unwrap()
        .replace("    request_headers_timeout_ms: 10000\n", "    request_headers_timeout_ms: 2500\n");
    assert!(text.contains("2500"), "the example's edge section changed");
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, text).unwrap();
    let loaded = Loaded::load(&path).unwrap();
    let rendered = render(&loaded, Target::Standalone).unwrap();
    let envoy = &rendered.files.iter().find(|f| f.path == "standalone/envoy.yaml").unwrap().content;
    let b = yaml(envoy);
    let monitors = &b["overload_manager"]["resource_monitors"];
    assert_eq!(monitors[0]["typed_config"]["max_heap_size_bytes"], 1_073_741_824u64);
    assert_eq!(monitors[1]["typed_config"]["max_active_downstream_connections"], 10_000);
    let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(hcm["request_headers_timeout"], "2.500s");
    assert_eq!(hcm["request_timeout"], "60s");
    assert_eq!(hcm["max_request_headers_kb"], 32);
    assert_eq!(hcm["common_http_protocol_options"]["headers_with_underscores_action"], "REJECT_REQUEST");
    assert_eq!(hcm["path_with_escaped_slashes_action"], "REJECT_REQUEST");
    assert_eq!(hcm["common_http_protocol_options"]["max_stream_duration"], "3600s");
    // The sidecar charges a reservation whose usage has not arrived 5 minutes after that.
    let sidecar = &rendered.files.iter().find(|f| f.path == "standalone/sidecar.yaml").unwrap().content;
    let parsed = gateway_ext_proc::config::Config::from_yaml(sidecar).unwrap();
    assert_eq!(parsed.metering.reservations.record_after_ms, 3_900_000);
}

/// A directory of its own for each call: the tests run in parallel threads of one process, and
/// each writes its `gateway.yaml` (one shared directory let a test read another's half-written
/// file: "the file is empty").
fn tempdir() -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("gatewayctl-render-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn standalone_bootstrap_shape() {
    let f = files(Target::Standalone);
    let b = yaml(&f["standalone/envoy.yaml"]);
    assert_eq!(b["admin"]["address"]["socket_address"]["address"], "127.0.0.1");
    assert_eq!(b["admin"]["address"]["socket_address"]["port_value"], 9901);
    let listener = &b["static_resources"]["listeners"][0];
    assert_eq!(listener["address"]["socket_address"]["address"], "0.0.0.0");
    assert_eq!(listener["address"]["socket_address"]["port_value"], 8080);
    assert_eq!(listener["per_connection_buffer_limit_bytes"], 4194304 + 1048576);
    let hcm = &listener["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(
        names(&hcm["http_filters"]),
        ["llm_gateway.filter", "llm_gateway.admission", "llm_gateway.guard", "envoy.filters.http.router"]
    );
    // The guard refuses what lacks the filter's facts or an admission (envoy/filters/guard.yaml).
    let guard = &hcm["http_filters"][2]["typed_config"]["rules"];
    assert_eq!(guard["action"], "ALLOW");
    let ids = &guard["policies"]["decided-and-admitted"]["principals"][0]["and_ids"]["ids"];
    assert_eq!(ids[0]["filter_state"]["key"], "wasm.llm_gateway.request");
    let admitted = &ids[1]["or_ids"]["ids"];
    assert_eq!(admitted[0]["filter_state"]["key"], "wasm.llm_gateway.admission");
    assert_eq!(admitted[0]["filter_state"]["string_match"]["exact"], "lease");
    let metadata = &admitted[1]["sourced_metadata"]["metadata_matcher"];
    assert_eq!(metadata["filter"], "llm_gateway");
    assert_eq!(metadata["path"][0]["key"], "admitted");
    // Metering: the gRPC access log to the sidecar, with the filter's usage.
    let log = &hcm["access_log"][0]["typed_config"]["common_config"];
    assert_eq!(log["grpc_service"]["envoy_grpc"]["cluster_name"], "llm_gateway_ext_proc");
    assert_eq!(
        log["filter_state_objects_to_log"],
        yaml("[wasm.llm_gateway.request, wasm.llm_gateway.usage]")
    );
    // Request headers are the client's to write: the sidecar is never sent them to meter by.
    assert!(hcm["access_log"][0]["typed_config"]["additional_request_headers_to_log"].is_null());
    let wasm = &hcm["http_filters"][0]["typed_config"]["config"];
    assert_eq!(wasm["allow_on_headers_stop_iteration"], true);
    assert_eq!(wasm["vm_config"]["code"]["local"]["filename"], "/etc/llm-gateway/gateway_filter.wasm");
    // The embedded plugin config is filter.json.
    let embedded: serde_json::Value =
        serde_json::from_str(wasm["configuration"]["value"].as_str().unwrap()).unwrap();
    let file: serde_json::Value = serde_json::from_str(&f["standalone/filter.json"]).unwrap();
    assert_eq!(embedded, file);
    let parsed = gateway_filter::config::Config::from_json(f["standalone/filter.json"].as_bytes()).unwrap();
    // The sidecar reads the filter state: the filter sets only the routing header upstream.
    assert_eq!(file["upstream_headers"], "routing");
    assert_eq!(parsed.upstream_headers, gateway_filter::config::UpstreamHeaders::Routing);

    // The fallback chain's route (envoy/fallback_route.yaml) comes first, then the generic
    // x-gateway-pool route and the default route of envoy/bootstrap.yaml.
    let routes = &hcm["route_config"]["virtual_hosts"][0]["routes"];
    assert_eq!(routes.as_sequence().unwrap().len(), 3);
    assert_eq!(routes[0]["match"]["headers"][0]["string_match"]["exact"], "pool_qwen");
    assert_eq!(routes[0]["route"]["cluster"], "pool_qwen");
    let retry = &routes[0]["route"]["retry_policy"];
    assert_eq!(retry["retry_on"], "connect-failure,refused-stream,reset,5xx");
    assert_eq!(retry["num_retries"], 1);
    assert_eq!(routes[1]["route"]["cluster_header"], "x-gateway-pool");
    // No route reaches a pool without the filter's x-gateway-pool: the catch-all answers 404.
    assert!(routes[2]["route"].is_null(), "{:?}", routes[2]);
    assert_eq!(routes[2]["direct_response"]["status"], 404);

    let clusters = &b["static_resources"]["clusters"];
    assert_eq!(
        names(clusters),
        ["llm_gateway_ext_proc", "pool_qwen-primary", "pool_qwen_spare", "pool_llama", "pool_qwen"]
    );
    let by_name = |n: &str| clusters.as_sequence().unwrap().iter().find(|c| c["name"] == n).unwrap().clone();
    let chain = by_name("pool_qwen");
    assert_eq!(chain["cluster_type"]["name"], "envoy.clusters.composite");
    assert_eq!(
        chain["cluster_type"]["typed_config"]["clusters"],
        yaml("[{name: pool_qwen-primary}, {name: pool_qwen_spare}]")
    );
    let primary = by_name("pool_qwen-primary");
    assert_eq!(primary["type"], "STATIC");
    assert_eq!(primary["health_checks"][0]["http_health_check"]["path"], "/health");
    assert_eq!(primary["health_checks"][0]["interval"], "5s");
    assert_eq!(primary["outlier_detection"]["consecutive_5xx"], 5);
    assert_eq!(primary["circuit_breakers"]["thresholds"][0]["max_requests"], 1024);
    assert_eq!(primary["load_assignment"]["endpoints"][0]["lb_endpoints"].as_sequence().unwrap().len(), 2);
    // A DNS name is resolved (every address is an endpoint).
    assert_eq!(by_name("pool_qwen_spare")["type"], "STRICT_DNS");
    let ext_proc = by_name("llm_gateway_ext_proc");
    assert_eq!(
        ext_proc["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            ["socket_address"],
        yaml("{address: 127.0.0.1, port_value: 50051}")
    );
}

#[test]
fn sidecar_configs_parse_and_differ_by_flavor() {
    let f = files(Target::All);
    let standalone = gateway_ext_proc::config::Config::from_yaml(&f["standalone/sidecar.yaml"]).unwrap();
    assert_eq!(standalone.listen.to_string(), "127.0.0.1:50051");
    assert_eq!(standalone.redis.url.as_deref(), Some("redis://127.0.0.1:6379/0"));
    let configmap = yaml(&f["kubernetes/sidecar-configmap.yaml"]);
    let pod =
        gateway_ext_proc::config::Config::from_yaml(configmap["data"]["sidecar.yaml"].as_str().unwrap())
            .unwrap();
    assert_eq!(pod.listen.to_string(), "0.0.0.0:50051");
    assert_eq!(
        pod.redis.url.as_deref(),
        Some("redis://llm-gateway-redis.llm-gateway.svc.cluster.local:6379/0")
    );
    // The Deployment rolls when the config changes.
    let deployment = yaml(&f["kubernetes/sidecar-deployment.yaml"]);
    let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["llm-gateway.io/sidecar-config-sha256"].as_str().unwrap().len(), 64);
    assert_eq!(annotations["prometheus.io/port"], "9464");
    // The pod's grace outlasts the sidecar's own (its default 10 s, then the last flush).
    assert_eq!(pod.shutdown_grace_ms, 10_000);
    assert_eq!(deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], 20);
    // The image pinned by its digest (kubernetes.sidecar.image_sha256), never by the tag alone.
    assert_eq!(
        deployment["spec"]["template"]["spec"]["containers"][0]["image"].as_str().unwrap(),
        format!("registry.example.com/llm-gateway-ext-proc:0.1.0@sha256:{ZERO_DIGEST}")
    );
}

#[test]
fn istio_inserts_wasm_then_ext_proc_before_the_router() {
    let f = exact(Target::Istio);
    let ef = yaml(&f["istio/envoyfilter.yaml"]);
    let patches = ef["spec"]["configPatches"].as_sequence().unwrap();
    let kinds: Vec<&str> = patches.iter().map(|p| p["applyTo"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["LISTENER", "NETWORK_FILTER", "EXTENSION_CONFIG", "HTTP_FILTER", "HTTP_FILTER", "HTTP_FILTER"]
    );
    let log = &patches[1]["patch"]["value"]["typed_config"]["access_log"][0]["typed_config"]["common_config"];
    assert_eq!(
        log["grpc_service"]["envoy_grpc"]["cluster_name"],
        "outbound|50051||llm-gateway-ext-proc.llm-gateway.svc.cluster.local"
    );
    let ecds = &patches[2]["patch"]["value"];
    assert_eq!(ecds["typed_config"]["config"]["allow_on_headers_stop_iteration"], true);
    assert_eq!(
        ecds["typed_config"]["config"]["vm_config"]["code"]["remote"]["http_uri"]["uri"],
        "oci://registry.example.com/llm-gateway-filter:0.1.0"
    );
    assert_eq!(ecds["typed_config"]["config"]["vm_config"]["code"]["remote"]["sha256"], ZERO_DIGEST);
    let inserted: Vec<&str> =
        patches[3..].iter().map(|p| p["patch"]["value"]["name"].as_str().unwrap()).collect();
    assert_eq!(inserted, ["llm_gateway.filter", "llm_gateway.admission", "llm_gateway.guard"]);
    let vs = yaml(&f["istio/virtualservice.yaml"]);
    let routes = vs["spec"]["http"].as_sequence().unwrap();
    // Only the x-gateway-pool routes reach a pool; the last answers the standalone's 404.
    for route in &routes[..routes.len() - 1] {
        assert!(!route["match"][0]["headers"]["x-gateway-pool"]["exact"].is_null(), "{route:?}");
    }
    let last = routes.last().unwrap();
    assert!(last["route"].is_null(), "{last:?}");
    assert_eq!(last["directResponse"]["status"], 404);
    assert_eq!(
        patches[4]["patch"]["value"]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"],
        "outbound|50051||llm-gateway-ext-proc.llm-gateway.svc.cluster.local"
    );
}

#[test]
fn istio_wasm_plugin_pins_the_module_digest() {
    let text = std::fs::read_to_string(EXAMPLE)
        .unwrap()
        .replace("  hosts: [\"*\"]\n", "  hosts: [\"*\"]\n  wasm_delivery: wasm_plugin\n");
    assert!(text.contains("wasm_delivery: wasm_plugin"), "the example's istio section changed");
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
    let rendered = render(&loaded, Target::Istio).unwrap();
    let file = rendered.files.iter().find(|f| f.path == "istio/wasmplugin.yaml").unwrap();
    let plugin = yaml(&file.content);
    assert_eq!(plugin["spec"]["url"], "oci://registry.example.com/llm-gateway-filter:0.1.0");
    assert_eq!(plugin["spec"]["sha256"], ZERO_DIGEST);
}

#[test]
fn envoy_gateway_policy_carries_the_plugin_config() {
    let f = files(Target::EnvoyGateway);
    let policy = yaml(&f["envoy-gateway/envoyextensionpolicy.yaml"]);
    let config = serde_json::to_string(&policy["spec"]["wasm"][0]["config"]).unwrap();
    gateway_filter::config::Config::from_json(config.as_bytes()).unwrap();
    assert_eq!(
        policy["spec"]["wasm"][0]["code"],
        yaml(&format!(
            "{{type: Image, image: {{url: registry.example.com/llm-gateway-filter:0.1.0, sha256: '{ZERO_DIGEST}'}}}}"
        ))
    );
    assert_eq!(policy["spec"]["extProc"][1]["shadowMode"], true);
    let route = yaml(&f["envoy-gateway/httproute.yaml"]);
    let rules = route["spec"]["rules"].as_sequence().unwrap();
    // One rule per pool, then the catch-all that enables the policy's filters on every request.
    assert_eq!(rules.len(), 4);
    assert_eq!(rules[3]["matches"][0]["path"]["value"], "/");
    // ... and reaches no pool.
    assert!(rules[3]["backendRefs"].is_null(), "{:?}", rules[3]);
    // Only on the listener the EnvoyPatchPolicy patches.
    assert_eq!(route["spec"]["parentRefs"][0]["sectionName"], "http");
}

#[test]
fn envoy_gateway_patch_policy_names_the_listener_of_each_xds_name_scheme() {
    let patch = yaml(&files(Target::EnvoyGateway)["envoy-gateway/envoypatchpolicy.yaml"]);
    assert_eq!(patch["metadata"]["namespace"], "envoy-gateway-system");
    assert_eq!(patch["spec"]["targetRef"]["name"], "eg");
    let patches = patch["spec"]["jsonPatches"].as_sequence().unwrap();
    assert_eq!(patches.len(), 6);
    assert!(patches.iter().all(|p| p["name"] == "tcp-80"), "{patches:?}");
    // Flow control's longest hold of a queued request's answer, on the admission filter.
    assert_eq!(patches[3]["operation"]["path"], "max_message_timeout");
    assert_eq!(patches[3]["operation"]["value"], "601s");
    let text =
        std::fs::read_to_string(EXAMPLE).unwrap().replace("xds_name_scheme: v2", "xds_name_scheme: v1");
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
    let rendered = render(&loaded, Target::EnvoyGateway).unwrap();
    let v1 = rendered.files.iter().find(|f| f.path == "envoy-gateway/envoypatchpolicy.yaml").unwrap();
    let patches = yaml(&v1.content)["spec"]["jsonPatches"].as_sequence().unwrap().clone();
    assert!(patches.iter().all(|p| p["name"] == "envoy-gateway-system/eg/http"), "{patches:?}");
    // The buffer: filter.max_body_bytes (example: 4 MiB) + 1 MiB, as the standalone listener's.
    assert_eq!(patches[5]["operation"]["value"], 5 * 1024 * 1024);
}

/// The example with `redis:` starting with `redis_first` (leases are on unless it says otherwise).
fn with_redis(target: Target, redis_first: &str) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let text = text.replace("redis:\n", &format!("redis:\n  {redis_first}\n"));
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
    render(&loaded, target).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect()
}

/// The example with leases off (`redis.lease_fraction: 0`): every request decided in the sidecar.
fn exact(target: Target) -> BTreeMap<String, String> {
    with_redis(target, "lease_fraction: 0")
}

#[test]
fn admission_leases_are_the_default_and_wrap_the_admission_filter() {
    let rendered = files(Target::Standalone);
    let sidecar = yaml(&rendered["standalone/sidecar.yaml"]);
    assert_eq!(sidecar["redis"]["lease_fraction"], yaml("0.01"));
    let filter: serde_json::Value = serde_json::from_str(&rendered["standalone/filter.json"]).unwrap();
    assert_eq!(filter["admission_leases"]["cluster"], "llm_gateway_ext_proc");
    let envoy = yaml(&rendered["standalone/envoy.yaml"]);
    let hcm = &envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let admission = &hcm["http_filters"][1];
    assert_eq!(admission["name"], "llm_gateway.admission");
    let matcher = &admission["typed_config"];
    assert_eq!(
        matcher["@type"],
        "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher"
    );
    // The ext_proc admission runs inside a composite filter, made only when the matcher picks it:
    // on no match (no lease), never for a leased request.
    assert_eq!(
        matcher["extension_config"]["typed_config"]["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.composite.v3.Composite"
    );
    let execute = &matcher["xds_matcher"]["on_no_match"]["action"]["typed_config"];
    assert_eq!(
        execute["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.composite.v3.ExecuteFilterAction"
    );
    let ext_proc = &execute["typed_config"]["typed_config"];
    assert_eq!(ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"], "llm_gateway_ext_proc");
    let skip = &matcher["xds_matcher"]["matcher_tree"]["exact_match_map"]["map"]["lease"]["action"];
    assert_eq!(
        skip["typed_config"]["@type"],
        "type.googleapis.com/envoy.extensions.filters.common.matcher.action.v3.SkipFilter"
    );
    // The skip is decided by the filter's state, which clients cannot write, not by a header.
    let input = &matcher["xds_matcher"]["matcher_tree"]["input"]["typed_config"];
    assert_eq!(input["key"], "wasm.llm_gateway.admission");
    // The admission reads the filter's decision from its state.
    let attributes = &ext_proc["request_attributes"];
    assert_eq!(attributes, &yaml(r#"["filter_state['wasm.llm_gateway.request']"]"#));
    // Istio: the same wrapper, and the filter asks the sidecar's Istio cluster.
    let istio = files(Target::Istio);
    let envoyfilter = &istio["istio/envoyfilter.yaml"];
    assert!(envoyfilter.contains("ExtensionWithMatcher"), "{envoyfilter}");
    assert!(envoyfilter.contains("ExecuteFilterAction"), "{envoyfilter}");
    let wasm_config = r#"\"admission_leases\":{\"cluster\":\"outbound|50051||llm-gateway-ext-proc.llm-gateway.svc.cluster.local\"}"#;
    assert!(envoyfilter.contains(wasm_config), "{envoyfilter}");
    // Envoy Gateway cannot render the wrapper: its filter asks for no lease, and its sidecar keeps
    // only its own token leases.
    let eg = files(Target::EnvoyGateway);
    assert!(eg.values().all(|f| !f.contains("ExtensionWithMatcher") && !f.contains("admission_leases")));
    assert!(
        eg["kubernetes/sidecar-configmap.yaml"].contains("lease_fraction: 0.01"),
        "{}",
        eg["kubernetes/sidecar-configmap.yaml"]
    );
    // Off with `lease_fraction: 0`, or with `filter.admission_leases: false` alone.
    for off in [exact(Target::Standalone), {
        let text = std::fs::read_to_string(EXAMPLE)
            .unwrap()
            .replace("filter:\n", "filter:\n  admission_leases: false\n");
        let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
        render(&loaded, Target::Standalone).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect()
    }] {
        assert!(!off["standalone/envoy.yaml"].contains("ExtensionWithMatcher"));
        assert!(!off["standalone/filter.json"].contains("admission_leases"));
    }
    let off = yaml(&exact(Target::Standalone)["standalone/sidecar.yaml"]);
    assert_eq!(off["redis"]["lease_fraction"], yaml("0.0"));
    // The example's pools are shed by their load: the sidecar leases them only when a pool says
    // so (its `admission_leases`), and gatewayctl renders that only when set.
    let pools = &sidecar["pools"];
    assert!(pools.as_sequence().unwrap().iter().all(|p| p["admission_leases"].is_null()), "{pools:?}");
    let text = std::fs::read_to_string(EXAMPLE).unwrap().replace(
        "    shedding: {max_in_flight: 256}\n",
        "    shedding: {max_in_flight: 256}\n    admission_leases: true\n",
    );
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
    let rendered = render(&loaded, Target::Standalone).unwrap();
    let sidecar = rendered.files.iter().find(|f| f.path == "standalone/sidecar.yaml").unwrap();
    let llama = yaml(&sidecar.content)["pools"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "pool_llama")
        .cloned()
        .unwrap();
    assert_eq!(llama["admission_leases"], true);
}

/// The example with pool_qwen and pool_llama picking (in that config order), both Services in the
/// sidecar's namespace, with `sidecar_extra` appended to the sidecar section.
fn picking(sidecar_extra: &str) -> Result<gatewayctl::render::Output, gatewayctl::config::ConfigError> {
    let dir = tempdir();
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let picker = "    picker: {prefix_weight: 3.0}\n    inference_pool: {match_labels: {app: vllm}, target_port: 8000}\n";
    let text = text
        .replace(
            "    service: {name: vllm-qwen, namespace: inference, port: 8000}\n",
            &format!("    service: {{name: vllm-qwen, namespace: llm-gateway, port: 8000}}\n{picker}"),
        )
        .replace(
            "    service: {name: vllm-llama, namespace: inference, port: 8000}\n",
            &format!("    service: {{name: vllm-llama, namespace: llm-gateway, port: 8000}}\n{picker}"),
        )
        .replace(
            "  metrics_listen: 127.0.0.1:9464",
            &format!("  metrics_listen: 127.0.0.1:9464\n{sidecar_extra}"),
        );
    assert_eq!(text.matches("picker:").count(), 2, "the example's pools changed");
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, text).unwrap();
    let loaded = Loaded::load(&path).unwrap();
    render(&loaded, Target::All)
}

#[test]
fn inference_pools_name_their_pools_endpoint_picker_port() {
    let rendered = picking("").unwrap();
    let files: BTreeMap<String, String> = rendered.files.into_iter().map(|f| (f.path, f.content)).collect();
    // The mesh sidecar: one endpoint-picker listener per picking pool, 9002 + k in config order.
    let configmap = yaml(&files["kubernetes/sidecar-configmap.yaml"]);
    let sidecar_yaml = configmap["data"]["sidecar.yaml"].as_str().unwrap();
    let sidecar = yaml(sidecar_yaml);
    let pickers: Vec<(&str, &str)> = sidecar["endpoint_pickers"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|e| (e["pool"].as_str().unwrap(), e["listen"].as_str().unwrap()))
        .collect();
    assert_eq!(pickers, [("pool_qwen", "0.0.0.0:9002"), ("pool_llama", "0.0.0.0:9003")]);
    let parsed = gateway_ext_proc::config::Config::from_yaml(sidecar_yaml).unwrap();
    assert!(parsed.pool_has_endpoint_picker("pool_llama"));
    // The standalone sidecar keeps picking on the admission path.
    assert!(yaml(&files["standalone/sidecar.yaml"]).get("endpoint_pickers").is_none());
    // Each InferencePool names its own pool's port of the sidecar's Service.
    for target in ["istio", "envoy-gateway"] {
        for (label, port) in [("pool-qwen", 9002), ("pool-llama", 9003)] {
            let pool = yaml(&files[&format!("{target}/inferencepool-{label}.yaml")]);
            let picker = &pool["spec"]["endpointPickerRef"];
            assert_eq!(picker["name"].as_str(), Some("llm-gateway-ext-proc"));
            assert_eq!(picker["port"]["number"].as_u64(), Some(port), "{target} {label}");
        }
    }
    // The Service and the container expose them as gRPC (Istio: HTTP/2).
    let service = yaml(&files["kubernetes/sidecar-service.yaml"]);
    let epp: Vec<&Value> = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|p| p["name"].as_str().unwrap().starts_with("grpc-epp-"))
        .collect();
    assert_eq!(epp.len(), 2);
    for (k, p) in epp.iter().enumerate() {
        assert_eq!(p["name"].as_str(), Some(format!("grpc-epp-{k}").as_str()));
        assert_eq!(p["port"].as_u64(), Some(9002 + k as u64));
        assert_eq!(p["targetPort"], p["name"]);
        assert_eq!(p["appProtocol"].as_str(), Some("grpc"));
    }
    let deployment = yaml(&files["kubernetes/sidecar-deployment.yaml"]);
    let ports = &deployment["spec"]["template"]["spec"]["containers"][0]["ports"];
    let container: Vec<(&str, u64)> = ports
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| (p["name"].as_str().unwrap(), p["containerPort"].as_u64().unwrap()))
        .collect();
    assert!(
        container.contains(&("grpc-epp-0", 9002)) && container.contains(&("grpc-epp-1", 9003)),
        "{container:?}"
    );
    // Only the gateway's pods (and, on Istio, its principals) reach them.
    let policy = yaml(&files["kubernetes/sidecar-networkpolicy.yaml"]);
    let gateway_ports: Vec<u64> = policy["spec"]["ingress"][0]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_u64().unwrap())
        .collect();
    assert_eq!(gateway_ports, [50051, 9002, 9003]);
    let authz = yaml(&files["istio/sidecar-authorizationpolicy.yaml"]);
    let to: Vec<&str> = authz["spec"]["rules"][0]["to"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|t| t["operation"]["ports"][0].as_str().unwrap())
        .collect();
    assert_eq!(to, ["50051", "9002", "9003"]);
}

#[test]
fn a_sidecar_port_on_an_endpoint_picker_port_is_refused() {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    assert!(text.contains("  metrics_listen: 127.0.0.1:9464"));
    let dir = tempdir();
    let text = text
        .replace(
            "    service: {name: vllm-llama, namespace: inference, port: 8000}\n",
            "    service: {name: vllm-llama, namespace: llm-gateway, port: 8000}\n    picker: {}\n    inference_pool: {match_labels: {app: vllm}, target_port: 8000}\n",
        )
        .replace("  metrics_listen: 127.0.0.1:9464", "  metrics_listen: 127.0.0.1:9002");
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, text).unwrap();
    let loaded = Loaded::load(&path).unwrap();
    let err = render(&loaded, Target::Istio).unwrap_err();
    assert_eq!(err.field, "sidecar.metrics_listen", "{err:?}");
    assert!(err.message.contains("endpoint picker port of pools[2]"), "{err:?}");
    // The standalone target has no endpoint-picker listener: nothing to collide with.
    assert!(render(&loaded, Target::Standalone).is_ok());
}

/// The example with flow control on pool_llama (issue 13).
fn flow_controlled(
    flow: &str,
    pool_flow: &str,
) -> Result<gatewayctl::render::Output, gatewayctl::config::ConfigError> {
    let dir = tempdir();
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let text = text.replace(
        "    shedding: {max_in_flight: 256}\n",
        &format!("    shedding: {{max_in_flight: 256}}\n    flow_control: {pool_flow}\n"),
    );
    let text = format!("{text}\nflow_control: {flow}\n");
    let path = dir.join("gateway.yaml");
    std::fs::write(&path, text).unwrap();
    render(&Loaded::load(&path).unwrap(), Target::All)
}

#[test]
fn flow_control_is_rendered_into_the_sidecar_config() {
    let flow = "{tiers: [{name: premium, max_queue_wait_ms: 1000}, {name: batch, max_queue_wait_ms: 10000, max_load: 0.6}], tenant_weights: {acme: 2}}";
    let rendered = flow_controlled(flow, "{max_queued: 500}").unwrap();
    // The example's tenants are standard and batch: premium's queue would stay empty.
    assert_eq!(
        rendered.notes.iter().filter(|n| n.starts_with("warning: ")).collect::<Vec<_>>(),
        ["warning: flow_control.tiers[0]: tier 'premium' matches no tenant's tier: its queue stays empty"]
    );
    let files: BTreeMap<_, _> = rendered.files.into_iter().map(|f| (f.path, f.content)).collect();
    let parsed = gateway_ext_proc::config::Config::from_yaml(&files["standalone/sidecar.yaml"]).unwrap();
    let tiers: Vec<_> = parsed
        .flow_control
        .as_ref()
        .unwrap()
        .tiers
        .iter()
        .map(|t| (t.name.as_str(), t.max_queue_wait_ms))
        .collect();
    assert_eq!(tiers, [("premium", 1000), ("batch", 10000)]);
    let pool = parsed.pools.iter().find(|p| p.name == "pool_llama").unwrap();
    assert_eq!(pool.flow_control.map(|f| f.max_queued), Some(500));
    assert_eq!(pool.max_in_flight, Some(256));
    // The admission filter may hold a queued request's answer (standalone bootstrap).
    assert!(
        files["standalone/envoy.yaml"].contains("max_message_timeout: \"601s\""),
        "{}",
        files["standalone/envoy.yaml"]
    );
    // The sidecar's own validation, reported against the gateway config's fields.
    let err =
        flow_controlled("{tiers: [{name: premium, max_queue_wait_ms: 0}]}", "{}").unwrap_err().to_string();
    assert!(err.contains("flow_control.tiers[0].max_queue_wait_ms: must be in 1..=600000"), "{err}");
    let err = flow_controlled(flow, "{max_queued: 0}").unwrap_err().to_string();
    assert!(err.contains("pools[2].flow_control.max_queued: must be in 1..=1000000"), "{err}");
    let err =
        flow_controlled("{tiers: [{name: premium, max_queue_wait_ms: 1}], tenant_weights: {ghost: 1}}", "{}")
            .unwrap_err()
            .to_string();
    assert!(err.contains("flow_control.tenant_weights.ghost: is not a tenant"), "{err}");
}

/// The example with `sidecar.metering.journal_path` set.
fn with_journal(path: &str) -> Result<Loaded, String> {
    let mut config = yaml(&std::fs::read_to_string(EXAMPLE).unwrap());
    let sidecar = config["sidecar"].as_mapping_mut().unwrap();
    let metering = sidecar
        .entry(Value::from("metering"))
        .or_insert_with(|| Value::Mapping(serde_yaml_ng::Mapping::new()));
    metering.as_mapping_mut().unwrap().insert(Value::from("journal_path"), Value::from(path));
    let text = serde_yaml_ng::to_string(&config).unwrap();
    Loaded::from_yaml(&text, "gateway.yaml", Path::new("../envoy/examples").to_path_buf())
        .map_err(|e| e.to_string())
}

#[test]
fn the_usage_journal_is_rendered_for_the_standalone_envoy_and_its_sidecar() {
    let loaded = with_journal("/var/lib/llm-gateway/usage.journal").unwrap();
    let out: BTreeMap<String, String> =
        render(&loaded, Target::Standalone).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect();
    let b = yaml(&out["standalone/envoy.yaml"]);
    let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(
        names(&hcm["access_log"]),
        ["envoy.access_loggers.http_grpc", "envoy.access_loggers.file", "envoy.access_loggers.file"]
    );
    let journal = &hcm["access_log"][1]["typed_config"];
    assert_eq!(journal["path"], "/var/lib/llm-gateway/usage.journal");
    assert_eq!(
        journal["log_format"]["json_format"]["facts"],
        "%FILTER_STATE(wasm.llm_gateway.request:PLAIN)%"
    );
    let sidecar = yaml(&out["standalone/sidecar.yaml"]);
    assert_eq!(sidecar["metering"]["journal"]["path"], "/var/lib/llm-gateway/usage.journal");
    let parsed = gateway_ext_proc::config::Config::from_yaml(&out["standalone/sidecar.yaml"]).unwrap();
    assert_eq!(parsed.metering.journal.unwrap().path, Path::new("/var/lib/llm-gateway/usage.journal"));
    // The mesh targets share no file with the gateway's Envoy: no journal there.
    let meshes: BTreeMap<String, String> =
        render(&loaded, Target::All).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect();
    assert!(!meshes["kubernetes/sidecar-configmap.yaml"].contains("journal"));
    // Without it, the example renders no journal.
    assert!(!files(Target::Standalone)["standalone/envoy.yaml"].contains("usage.journal"));
    let error = with_journal("usage.journal").unwrap_err();
    assert!(error.contains("sidecar.metering.journal_path"), "{error}");
}

#[test]
fn the_kubernetes_target_renders_the_rules_and_a_pod_monitor_apart_from_the_sidecar() {
    let f = files(Target::All);
    let rule = yaml(&f["kubernetes/monitoring/prometheusrule.yaml"]);
    assert_eq!(
        (rule["apiVersion"].as_str(), rule["kind"].as_str()),
        (Some("monitoring.coreos.com/v1"), Some("PrometheusRule"))
    );
    let shipped = yaml(&std::fs::read_to_string("../deploy/prometheus/rules.yaml").unwrap());
    assert_eq!(
        rule["spec"]["groups"], shipped["groups"],
        "the PrometheusRule carries deploy/prometheus/rules.yaml"
    );
    let monitor = yaml(&f["kubernetes/monitoring/sidecar-podmonitor.yaml"]);
    let endpoint = &monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["relabelings"][0]["replacement"], "llm-gateway-sidecar", "the alerts' job");
    let deployment = yaml(&f["kubernetes/sidecar-deployment.yaml"]);
    let ports = &deployment["spec"]["template"]["spec"]["containers"][0]["ports"];
    assert!(ports.as_sequence().unwrap().iter().any(|p| p["name"] == endpoint["port"]), "{ports:?}");
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"],
        deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
            .as_str()
            .map(|n| yaml(&format!("app.kubernetes.io/name: {n}")))
            .unwrap()
    );
    // Their own kustomization: the sidecar's applies without the Prometheus Operator's CRDs.
    assert!(!f["kubernetes/kustomization.yaml"].contains("monitoring"));
    assert!(f["kubernetes/monitoring/kustomization.yaml"].contains("prometheusrule.yaml"));
    // Without sidecar.metrics_listen there is nothing to scrape: no monitoring objects.
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let line = text.lines().find(|l| l.trim_start().starts_with("metrics_listen:")).unwrap();
    let text = text.replace(&format!("{line}\n"), "");
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
    let out = render(&loaded, Target::All).unwrap();
    assert!(!out.files.iter().any(|f| f.path.starts_with("kubernetes/monitoring/")));
}

#[test]
fn live_config_moves_the_filters_configuration_into_an_ecds_file() {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let text = text.replacen("envoy:\n", "envoy:\n  live_config: {dir: /etc/llm-gateway/live}\n", 1);
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
    let f: BTreeMap<String, String> =
        render(&loaded, Target::Standalone).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect();
    let b = yaml(&f["standalone/envoy.yaml"]);
    let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filter = &hcm["http_filters"][0];
    assert!(filter["typed_config"].is_null(), "the configuration is not in the bootstrap");
    let source = &filter["config_discovery"]["config_source"]["path_config_source"];
    assert_eq!(source["path"], "/etc/llm-gateway/live/filter.json");
    assert_eq!(source["watched_directory"]["path"], "/etc/llm-gateway/live");
    assert_eq!(
        filter["config_discovery"]["type_urls"][0],
        "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
    );
    let ecds: serde_json::Value = serde_json::from_str(&f["standalone/live/filter.json"]).unwrap();
    let resource = &ecds["resources"][0];
    assert_eq!(resource["name"], filter["name"].as_str().unwrap());
    let value = resource["typed_config"]["config"]["configuration"]["value"].as_str().unwrap();
    let embedded: serde_json::Value = serde_json::from_str(value).unwrap();
    let rendered: serde_json::Value = serde_json::from_str(&f["standalone/filter.json"]).unwrap();
    assert_eq!(embedded, rendered, "the ECDS file carries the filter's configuration");
    // Without it nothing changes: the configuration stays in the bootstrap.
    assert!(!files(Target::Standalone).contains_key("standalone/live/filter.json"));
    let relative = text.replace("{dir: /etc/llm-gateway/live}", "{dir: live}");
    let err =
        Loaded::from_yaml(&relative, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap_err();
    assert!(err.to_string().contains("envoy.live_config.dir: must be an absolute path"), "{err}");
}

#[test]
fn the_request_log_is_on_by_default_to_stdout_and_can_be_moved_or_turned_off() {
    let hcm_of = |text: &str| {
        let loaded = Loaded::from_yaml(text, "gateway.yaml", Path::new("../envoy/examples").to_path_buf())
            .map_err(|e| e.to_string())?;
        let out: BTreeMap<String, String> = render(&loaded, Target::Standalone)
            .unwrap()
            .files
            .into_iter()
            .map(|f| (f.path, f.content))
            .collect();
        let b = yaml(&out["standalone/envoy.yaml"]);
        Ok::<_, String>(
            b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"].clone(),
        )
    };
    let example = std::fs::read_to_string(EXAMPLE).unwrap();
    let hcm = hcm_of(&example).unwrap();
    assert_eq!(names(&hcm["access_log"]), ["envoy.access_loggers.http_grpc", "envoy.access_loggers.file"]);
    let log = &hcm["access_log"][1]["typed_config"];
    assert_eq!(log["path"], "/dev/stdout");
    let fields = &log["log_format"]["json_format"];
    for (field, command) in [
        ("response_flags", "%RESPONSE_FLAGS%"),
        ("response_code_details", "%RESPONSE_CODE_DETAILS%"),
        ("upstream_host", "%UPSTREAM_HOST%"),
        ("picked_endpoint", "%DYNAMIC_METADATA(llm_gateway:picked_endpoint)%"),
        ("queue_wait_ms", "%DYNAMIC_METADATA(llm_gateway:queue_wait_ms)%"),
        ("tenant", "%FILTER_STATE(wasm.llm_gateway.tenant:PLAIN)%"),
        ("api_key", "%FILTER_STATE(wasm.llm_gateway.api_key:PLAIN)%"),
        ("model", "%FILTER_STATE(wasm.llm_gateway.model:PLAIN)%"),
        ("refusal", "%FILTER_STATE(wasm.llm_gateway.refusal:PLAIN)%"),
    ] {
        assert_eq!(fields[field], command, "{field}");
    }
    let text = serde_yaml_ng::to_string(log).unwrap().to_lowercase();
    for secret in ["authorization", "x-api-key"] {
        assert!(!text.contains(secret), "the request log must not carry {secret}");
    }
    let with =
        |access_log: &str| example.replacen("envoy:\n", &format!("envoy:\n  access_log: {access_log}\n"), 1);
    assert!(example.contains("envoy:\n"), "the example has an envoy section");
    let hcm = hcm_of(&with("{path: /var/log/llm-gateway/requests.log}")).unwrap();
    assert_eq!(hcm["access_log"][1]["typed_config"]["path"], "/var/log/llm-gateway/requests.log");
    let hcm = hcm_of(&with("{enabled: false}")).unwrap();
    assert_eq!(names(&hcm["access_log"]), ["envoy.access_loggers.http_grpc"]);
    let err = hcm_of(&with("{path: requests.log}")).unwrap_err();
    assert!(err.contains("envoy.access_log.path: must be an absolute path"), "{err}");
}

#[test]
fn a_native_module_takes_the_wasm_filters_place_with_the_same_configuration() {
    let text = std::fs::read_to_string(EXAMPLE).unwrap();
    let wasm = "wasm_file: /etc/llm-gateway/gateway_filter.wasm";
    assert!(text.contains(wasm), "the example names its wasm_file so");
    let text = text.replace(wasm, "native_module: lib/libgateway_filter_native.so");
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("/etc/llm-gateway").to_path_buf()).unwrap();
    // `all` renders the standalone target for a native module as for a wasm file.
    let f: BTreeMap<String, String> =
        render(&loaded, Target::All).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect();
    let b = yaml(&f["standalone/envoy.yaml"]);
    let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    assert_eq!(
        names(&hcm["http_filters"]),
        ["llm_gateway.filter", "llm_gateway.admission", "llm_gateway.guard", "envoy.filters.http.router"]
    );
    let native = &hcm["http_filters"][0]["typed_config"];
    assert_eq!(
        native["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
    );
    // Relative to the config file's directory.
    assert_eq!(
        native["dynamic_module_config"]["module"]["local"]["filename"],
        "/etc/llm-gateway/lib/libgateway_filter_native.so"
    );
    let embedded: serde_json::Value =
        serde_json::from_str(native["filter_config"]["value"].as_str().unwrap()).unwrap();
    let file: serde_json::Value = serde_json::from_str(&f["standalone/filter.json"]).unwrap();
    assert_eq!(embedded, file);
    // The mesh targets still load the wasm module.
    assert!(f["istio/envoyfilter.yaml"].contains("envoy.wasm.runtime.v8"));
}

#[test]
fn a_native_module_admits_from_leases_as_the_wasm_filter_does() {
    let text = std::fs::read_to_string(EXAMPLE)
        .unwrap()
        .replace(
            "wasm_file: /etc/llm-gateway/gateway_filter.wasm",
            "native_module: /opt/libgateway_filter_native.so",
        )
        .replace("filter:\n", "filter:\n  admission_leases: true\n");
    let loaded = Loaded::from_yaml(&text, EXAMPLE, Path::new("../envoy/examples").to_path_buf()).unwrap();
    let f: BTreeMap<String, String> =
        render(&loaded, Target::Standalone).unwrap().files.into_iter().map(|f| (f.path, f.content)).collect();
    let b = yaml(&f["standalone/envoy.yaml"]);
    let hcm = &b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let native = &hcm["http_filters"][0]["typed_config"];
    let embedded: serde_json::Value =
        serde_json::from_str(native["filter_config"]["value"].as_str().unwrap()).unwrap();
    assert_eq!(embedded["admission_leases"]["cluster"], "llm_gateway_ext_proc");
    assert_eq!(
        hcm["http_filters"][1]["typed_config"]["@type"],
        "type.googleapis.com/envoy.extensions.common.matching.v3.ExtensionWithMatcher"
    );
}
