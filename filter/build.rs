//! Compiles the lease messages the filter exchanges with the sidecar
//! (`proto/llm_gateway/v1/lease.proto`) with protox (pure Rust, no `protoc`) and prost-build.
//! Build scripts run on the host, so this works for the `wasm32-wasip1` target too.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "../proto/llm_gateway/v1/lease.proto";
    println!("cargo:rerun-if-changed={file}");
    let descriptors = protox::compile([file], ["../proto"])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
