use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(env::var("OUT_DIR")?);
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("tokenmesh_descriptor.bin"))
        .compile_protos(
            &["tokenmesh/v1/tokenmesh.proto", "tokenmesh/v1/control.proto"],
            &["."],
        )?;
    println!("cargo:rerun-if-changed=tokenmesh/v1/tokenmesh.proto");
    println!("cargo:rerun-if-changed=tokenmesh/v1/control.proto");
    Ok(())
}
