# syntax=docker/dockerfile:1
# The gateway's two images built with docker, for teams that build with it. `make images` builds
# the same two without a container daemon (tools/oci_image.py; docs/deploy.md, "Images"):
#
#   docker build --target ext-proc -t REGISTRY/llm-gateway-ext-proc:0.1.0 .
#   docker build --target filter   -t REGISTRY/llm-gateway-filter:0.1.0 .
#
# The same files, owners, modes, user and entrypoint as `make images` (tests/test_images.py checks
# this file against them); not the same digests (docker writes its own timestamps and, with the
# classic builder, docker media types): pin the digest your registry reports after the push.
# Needs BuildKit (docker 23 and later) for COPY --chmod.

# The project's toolchain (Rust 1.95) on Debian bookworm, as the project's machines; musl-gcc
# compiles ring's C for the static sidecar.
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools \
 && rm -rf /var/lib/apt/lists/* \
 && rustup target add x86_64-unknown-linux-musl wasm32-wasip1
WORKDIR /src
COPY . .
RUN cargo build --locked --profile image --target x86_64-unknown-linux-musl -p gateway-ext-proc \
 && cargo build --release --locked --target wasm32-wasip1 -p gateway-filter

# The sidecar: the static binary, owned by root, run as 65532 (gatewayctl's Deployment sets the
# same runAsUser / runAsGroup); no shell, no libc, nothing else.
FROM scratch AS ext-proc
COPY --from=build --chown=0:0 --chmod=0755 /src/target/x86_64-unknown-linux-musl/image/gateway-ext-proc /gateway-ext-proc
USER 65532:65532
ENTRYPOINT ["/gateway-ext-proc"]

# The wasm filter as the Wasm image specification's compat variant (one layer holding
# plugin.wasm), what Istio's WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy pull.
FROM scratch AS filter
COPY --from=build --chown=0:0 --chmod=0644 /src/target/wasm32-wasip1/release/gateway_filter.wasm /plugin.wasm
