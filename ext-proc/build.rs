//! Compiles the project's own protobuf definitions (`proto/`) with protox (a pure-Rust protobuf
//! compiler, so no `protoc` binary is needed) and prost-build.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = "../proto";
    let file = "../proto/llm_gateway/v1/usage.proto";
    println!("cargo:rerun-if-changed={file}");
    let descriptors = protox::compile([file], [proto_root])?;
    prost_build::Config::new().compile_fds(descriptors)?;
    Ok(())
}
