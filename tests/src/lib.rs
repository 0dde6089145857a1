//! Harness for the end-to-end suites: starts real etcd, workers, routers and
//! control-plane replicas on ephemeral loopback ports, waits for them with
//! readiness probes (never fixed sleeps), and stops them when dropped.
//!
//! Every item is re-exported at the crate root, so a suite says
//! `use tokenmesh_tests::*;`; the modules say where each piece lives.
pub mod clients;
pub mod control;
pub mod etcd;
pub mod fixtures;
pub mod mesh;
pub mod metrics;
pub mod model;
pub mod openai;
pub mod pki;
pub mod process;
pub mod raw;
pub mod upstream;

pub use clients::{generate_client, grpcurl, grpcurl_output};
pub use etcd::{Etcd, EtcdCluster};
pub use fixtures::{collect, collect_rest, france_request, prompt_request, Collected};
pub use mesh::{
    etcd_router, real_worker, static_file, static_router, wait_idle, RouterProc, WorkerOpts,
    WorkerProc,
};
pub use metrics::{http_get, scrape, scrape_text, series_names, sum_of};
pub use model::{model_path, MODEL};
pub use openai::{
    curl, http_router, http_router_with, openai_client, openai_command, openai_spawn, post_json,
    HttpRouter,
};
pub use pki::{channel, Creds, Pki};
pub use process::{bin, bin_dir, eventually, free_port, Proc};
pub use raw::{raw_call, RawCodec};
pub use upstream::{llama_cpp_bin, scripted_engine, LlamaServer};
