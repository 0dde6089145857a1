//! The router's OpenAI-compatible HTTP API as the suites reach it: a router
//! started with `--http-listen`, curl (for SSE with `-N`, raw bodies and
//! headers) and tests/python/openai_client.py (the official `openai`
//! library and LangChain).
use crate::mesh::{static_file, RouterProc, WorkerProc};
use crate::model::MODEL;
use crate::process::{eventually, free_port};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

/// A router with its HTTP API on `http` (`127.0.0.1:PORT`).
pub struct HttpRouter {
    pub router: RouterProc,
    pub http: String,
}

impl HttpRouter {
    /// `http://127.0.0.1:PORT/v1`, the base URL OpenAI's clients take.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.http)
    }

    /// `http://127.0.0.1:PORT{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }
}

/// A plaintext router over a static file listing `workers`, with its HTTP
/// API on a free port and the `extra` flags, once every worker is ready
/// behind it and the HTTP API answers.
pub async fn http_router(dir: &Path, workers: &[&WorkerProc], extra: &[&str]) -> HttpRouter {
    let mut args = vec!["--static".to_string(), static_file(dir, workers)];
    args.extend(extra.iter().map(|s| s.to_string()));
    http_router_with(dir, args, None, workers.len()).await
}

/// A router started with `args` (discovery and more) plus `--http-listen`
/// on a free port, once `ready` workers are ready and the HTTP port accepts.
pub async fn http_router_with(
    dir: &Path,
    mut args: Vec<String>,
    tls: Option<(std::path::PathBuf, crate::pki::Creds)>,
    ready: usize,
) -> HttpRouter {
    let http = format!("127.0.0.1:{}", free_port());
    args.extend(["--http-listen".to_string(), http.clone()]);
    let router = RouterProc::start_ready(&args, tls, dir, ready).await;
    let up = eventually(Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(&http).await.is_ok()
    })
    .await;
    assert!(
        up,
        "the HTTP API does not accept:\n{}",
        router.proc.log_text()
    );
    HttpRouter { router, http }
}

/// `curl -sS args` with the response's status appended on a last line of
/// its own (`-w`), and its exit status.
pub fn curl(args: &[&str]) -> (u16, String, Output) {
    let out = Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl is installed");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = stdout.rsplit_once('\n').unwrap_or(("", stdout.as_str()));
    (code.trim().parse().unwrap_or(0), body.to_string(), out)
}

/// POSTs `body` as JSON to `url` with curl; (status, body as JSON).
pub fn post_json(url: &str, body: &str, headers: &[&str]) -> (u16, serde_json::Value) {
    let mut args = vec![url, "-H", "Content-Type: application/json", "-d", body];
    for h in headers {
        args.extend(["-H", h]);
    }
    let (code, body, _) = curl(&args);
    let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    (code, json)
}

/// The command line of tests/python/openai_client.py `command` against
/// `base_url` (model [`MODEL`]) with `extra` arguments.
pub fn openai_command(command: &str, base_url: &str, extra: &[&str]) -> Command {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root");
    let python = std::env::var("TOKENMESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(python);
    cmd.arg(root.join("tests/python/openai_client.py"))
        .arg(command)
        .args(["--base-url", base_url, "--model", MODEL])
        .args(extra);
    cmd
}

/// Runs openai_client.py `command`; it must exit 0; its last JSON line.
pub fn openai_client(command: &str, base_url: &str, extra: &[&str]) -> serde_json::Value {
    let out = openai_command(command, base_url, extra)
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "openai_client.py {command} {extra:?}:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// openai_client.py `command` started with its stdout piped, for a test
/// that reads its chunks as they arrive.
pub fn openai_spawn(command: &str, base_url: &str, extra: &[&str]) -> Child {
    openai_command(command, base_url, extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python runs")
}
