//! Compiles the project's own protobuf definitions (`proto/`) with protox (a pure-Rust protobuf
//! compiler, so no `protoc` binary is needed) and tonic-prost-build (messages, and the server of
//! the admission-lease service).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = "../proto";
    let files = ["../proto/llm_gateway/v1/usage.proto", "../proto/llm_gateway/v1/lease.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, [proto_root])?;
    tonic_prost_build::configure().build_client(false).compile_fds(descriptors)?;
    Ok(())
}
