//! `--cpu-simd` and `--cpu-vnni` take 0/1/true/false, and their environment
//! variables keep working as they did when the kernels read them directly
//! (`TOKENMESH_CPU_SIMD=0`). Its own test binary, as it sets the environment.
use clap::Parser;
use tokenmesh_worker::config::WorkerConfig;

fn parse(args: &[&str]) -> WorkerConfig {
    WorkerConfig::try_parse_from(std::iter::once("tokenmesh-worker").chain(args.iter().copied()))
        .expect("flags parse")
}

#[test]
fn kernel_switches_accept_numbers_and_words_from_flags_and_environment() {
    let on = parse(&[]);
    assert!(on.cpu_simd && on.cpu_vnni);
    for off in ["0", "false"] {
        let c = parse(&["--cpu-simd", off, "--cpu-vnni", off]);
        assert!(!c.cpu_simd && !c.cpu_vnni, "{off}");
    }
    assert!(parse(&["--cpu-simd", "1"]).cpu_simd);
    assert!(WorkerConfig::try_parse_from(["tokenmesh-worker", "--cpu-simd", "maybe"]).is_err());
    std::env::set_var("TOKENMESH_CPU_SIMD", "0");
    std::env::set_var("TOKENMESH_CPU_VNNI", "false");
    let c = parse(&[]);
    assert!(!c.cpu_simd && !c.cpu_vnni);
    // A flag wins over the environment.
    assert!(parse(&["--cpu-simd", "true"]).cpu_simd);
}
