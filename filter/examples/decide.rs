//! The filter's body-phase decision timed natively, with no Envoy and no VM: parse, validation,
//! routing, context bounds and rewrites of one chat request body, repeated.
//!
//! ```sh
//! cargo run --release -p gateway-filter --example decide -- BODY.json [REPEAT]
//! ```
//! Prints one JSON line: body bytes, then the time per request (µs, mean) of a full `serde_json`
//! parse, of the top-level scan (`json_scan::scan_object`, what bodies over `full_parse_max_bytes`
//! get) and of the whole decision.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, missing_docs)]

use std::time::Instant;

use gateway_filter::config::Config;
use gateway_filter::pipeline::{on_request_body, PendingRequest};
use gateway_filter::request::{parse_json, Endpoint};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: decide BODY.json [REPEAT]");
    let repeat: u32 = args.next().map_or(20, |r| r.parse().expect("REPEAT: a number"));
    let body = std::fs::read(path).expect("read body");
    let config = Config::from_json(
        br#"{"tenants":[{"id":"t","api_keys_sha256":["0000000000000000000000000000000000000000000000000000000000000000"]}],
            "models":[{"name":"sim-model","pool":"p","max_model_len":100000000}]}"#,
    )
    .expect("config");
    let pending = PendingRequest {
        endpoint: Endpoint::ChatCompletions,
        tenant: 0,
        api_key: 0,
        request_id: None,
        has_content_length: true,
        accepts_coding: false,
    };
    let t = Instant::now();
    for _ in 0..repeat {
        std::hint::black_box(parse_json(&body).expect("parse"));
    }
    let parse_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(repeat);
    let t = Instant::now();
    for _ in 0..repeat {
        std::hint::black_box(gateway_filter::json_scan::scan_object(&body).expect("scan"));
    }
    let scan_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(repeat);
    let t = Instant::now();
    for _ in 0..repeat {
        std::hint::black_box(on_request_body(&config, &pending, &body).expect("decide"));
    }
    let decide_us = t.elapsed().as_secs_f64() * 1e6 / f64::from(repeat);
    println!(
        r#"{{"body_bytes":{},"parse_us":{parse_us:.1},"scan_us":{scan_us:.1},"decide_us":{decide_us:.1}}}"#,
        body.len()
    );
}
