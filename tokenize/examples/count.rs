//! Counts prompt tokens with a model's tokenizer files: the tool behind the exactness tests
//! (`tests/test_token_counts.py`) and the speed measurements, and a way for operators to see what
//! the gateway would count.
//!
//! ```text
//! count --spec SPEC [--info] [--bench FILE [--seconds S] [--chat]]
//! ```
//!
//! `SPEC` is JSON, inline or `@path`: `{"tokenizer": {...}, "chat_template": {...}}` with the
//! shapes of `gateway_tokenize::spec` (`chat_template` optional).
//!
//! * default: reads JSON lines on stdin and writes one JSON line per input line:
//!   `{"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": {}, "render": false}`
//!   (chat), `{"text": "..."}` (a completions prompt) or `{"rendered": "..."}` (text counted as is)
//!   → `{"count": N}` (plus `"rendered": "..."` for chat when `render` is true), or
//!   `{"error": "..."}`.
//! * `--info`: `{"max_token_bytes": N|null, "rss_kib_before_load": K, "rss_kib": K}`: the resident
//!   memory (Linux `VmRSS`, KiB; null elsewhere) before and after loading the tokenizer, which is
//!   what one loaded tokenizer costs the sidecar (`bench/overhead.py`, scenario `memory`).
//! * `--bench FILE`: counts the file's text (as a completions prompt, or as one user message
//!   with `--chat`) repeatedly for `S` seconds (default 3) on one thread and prints
//!   `{"bytes": B, "tokens": T, "iterations": I, "tokens_per_s": ..., "ms_per_count": ...}`.

use std::error::Error;
use std::io::{BufRead, Write};
use std::time::{Duration, Instant};

use gateway_tokenize::spec::{ChatTemplateSpec, TokenizerSpec};
use gateway_tokenize::{ChatOptions, ModelTokenizer};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Spec {
    tokenizer: TokenizerSpec,
    #[serde(default)]
    chat_template: Option<ChatTemplateSpec>,
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut spec: Option<String> = None;
    let mut info = false;
    let mut bench: Option<String> = None;
    let mut seconds = 3.0f64;
    let mut chat = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--spec" => spec = it.next().cloned(),
            "--info" => info = true,
            "--bench" => bench = it.next().cloned(),
            "--seconds" => seconds = it.next().ok_or("--seconds needs a value")?.parse()?,
            "--chat" => chat = true,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let spec = spec.ok_or("--spec is required")?;
    let spec_text = match spec.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path)?,
        None => spec,
    };
    let spec: Spec = serde_json::from_str(&spec_text)?;
    let rss_before = resident_kib();
    let tokenizer = ModelTokenizer::load(&spec.tokenizer, spec.chat_template.as_ref())?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();

    if info {
        writeln!(
            out,
            "{}",
            json!({"max_token_bytes": tokenizer.max_token_bytes(), "rss_kib_before_load": rss_before,
                   "rss_kib": resident_kib()})
        )?;
        return Ok(());
    }
    if let Some(path) = bench {
        let text = std::fs::read_to_string(&path)?;
        let messages = json!([{"role": "user", "content": text}]);
        let count = || -> Result<usize, Box<dyn Error>> {
            Ok(if chat {
                tokenizer.count_chat(&messages, &ChatOptions::default())?
            } else {
                tokenizer.count_text(&text)?
            })
        };
        let tokens = count()?;
        let budget = Duration::from_secs_f64(seconds);
        let start = Instant::now();
        let mut iterations = 0u64;
        while start.elapsed() < budget || iterations == 0 {
            std::hint::black_box(count()?);
            iterations += 1;
        }
        let elapsed = start.elapsed().as_secs_f64();
        writeln!(
            out,
            "{}",
            json!({
                "bytes": text.len(),
                "tokens": tokens,
                "iterations": iterations,
                "tokens_per_s": (tokens as f64 * iterations as f64 / elapsed).round(),
                "ms_per_count": elapsed * 1000.0 / iterations as f64,
            })
        )?;
        return Ok(());
    }

    for line in std::io::stdin().lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let input: Value = serde_json::from_str(&line)?;
        let result = if let Some(messages) = input.get("messages") {
            let options = ChatOptions {
                add_generation_prompt: input
                    .get("add_generation_prompt")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
                template_kwargs: input.get("chat_template_kwargs").and_then(Value::as_object),
            };
            tokenizer.render_chat(messages, &options).and_then(|text| {
                let n = tokenizer.count_rendered(&text)?;
                Ok(if input.get("render").and_then(Value::as_bool) == Some(true) {
                    json!({"count": n, "rendered": text})
                } else {
                    json!({"count": n})
                })
            })
        } else if let Some(text) = input.get("text").and_then(Value::as_str) {
            tokenizer.count_text(text).map(|n| json!({"count": n}))
        } else if let Some(text) = input.get("rendered").and_then(Value::as_str) {
            tokenizer.count_rendered(text).map(|n| json!({"count": n}))
        } else {
            return Err(format!("expected messages, text or rendered: {line}").into());
        };
        let v = result.unwrap_or_else(|e| json!({"error": e.to_string()}));
        writeln!(out, "{v}")?;
    }
    Ok(())
}

/// This process's resident memory (`VmRSS` of /proc/self/status), in KiB; `None` off Linux.
fn resident_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
