//! Engines for the upstream-worker suites: a real llama.cpp `llama-server`
//! (from `TOKENMESH_LLAMA_CPP`, which scripts/llama-cpp.sh builds) serving
//! the test model, and a tiny scripted engine that answers badly on purpose.
use crate::metrics::http_get;
use crate::model::model_path;
use crate::process::{eventually, free_port, Proc};
use anyhow::{bail, Result};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `$TOKENMESH_LLAMA_CPP/bin/NAME`; the suite fails (never skips) without it.
pub fn llama_cpp_bin(name: &str) -> PathBuf {
    let root = std::env::var_os("TOKENMESH_LLAMA_CPP").unwrap_or_else(|| {
        panic!(
            "TOKENMESH_LLAMA_CPP is not set: point it at a llama.cpp build with bin/{name} \
             (scripts/llama-cpp.sh builds one into target/llama.cpp; scripts/test.sh sets it)"
        )
    });
    let p = PathBuf::from(root).join("bin").join(name);
    assert!(
        p.is_file(),
        "{} is missing: run scripts/llama-cpp.sh",
        p.display()
    );
    p
}

/// A llama-server process.
pub struct LlamaServer {
    /// `127.0.0.1:PORT`.
    pub addr: String,
    pub proc: Proc,
    /// Its flags, to start it again on the same port.
    args: Vec<String>,
    name: String,
}

impl LlamaServer {
    /// Starts llama-server on the test model (one thread, `slots` parallel
    /// sequences, `--metrics`) and waits until `/health` answers 200.
    pub async fn start(name: &str, slots: usize, dir: &Path) -> Result<Self> {
        let port = free_port();
        let args: Vec<String> = [
            "-m",
            &model_path().display().to_string(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "-t",
            "1",
            "-np",
            &slots.to_string(),
            "-c",
            &(2048 * slots).to_string(),
            "--metrics",
            "--no-webui",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let proc = Proc::spawn(name, &llama_cpp_bin("llama-server"), &args, dir)?;
        let mut server = Self {
            addr: format!("127.0.0.1:{port}"),
            proc,
            args,
            name: name.into(),
        };
        server.wait_healthy().await?;
        Ok(server)
    }

    /// `http://127.0.0.1:PORT`, for `--upstream-url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Starts it again, on the same port, after a kill.
    pub async fn restart(&mut self, dir: &Path) -> Result<()> {
        self.proc = Proc::spawn(
            &format!("{}-again", self.name),
            &llama_cpp_bin("llama-server"),
            &self.args,
            dir,
        )?;
        self.wait_healthy().await
    }

    async fn wait_healthy(&mut self) -> Result<()> {
        let addr = self.addr.clone();
        let healthy = eventually(Duration::from_secs(60), || {
            let addr = addr.clone();
            async move { matches!(http_get(&addr, "/health").await, Ok((200, _))) }
        })
        .await;
        if !healthy || !self.proc.running() {
            bail!(
                "llama-server {} did not become healthy:\n{}",
                self.name,
                self.proc.log_text()
            );
        }
        Ok(())
    }
}

/// An engine that speaks llama-server's API just well enough to be set up,
/// then answers each completion by the first character of its prompt (text,
/// or text followed by ids; it counts one prompt token per character and id,
/// as its `/tokenize` gives one id per character, its code point):
/// `a` → HTTP 500, `b` → a line that is not JSON, `c` → two tokens and then
/// the end of the stream without a finish, `d` → HTTP 400, `e` → HTTP 503,
/// `p` → one token whose text is the request's `cache_prompt` field
/// (` cache_prompt=true`), `m` → one token whose text is the prompt as sent
/// (JSON), `r` → the first such request read and its connection closed
/// unanswered (as a server closing a kept-alive connection), later ones
/// answered; anything else → two tokens and a proper finish.
pub const SCRIPTED_ENGINE: &str = r#"
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

class Engine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    dropped = False
    def log_message(self, *a):
        sys.stderr.write("scripted: " + (a[0] % a[1:]) + "\n")
    def answer(self, status, body, ctype="application/json"):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health":
            self.answer(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.answer(200, {"data": [{"id": "scripted", "meta": {"n_vocab": 1000}}]})
        elif self.path == "/props":
            self.answer(200, {"default_generation_settings": {"n_ctx": 512}, "eos_token": ""})
        else:
            self.answer(404, {"error": {"code": 404, "message": "no " + self.path}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/tokenize":
            self.answer(200, {"tokens": [ord(c) % 1000 for c in body["content"]]})
            return
        if self.path != "/completion":
            self.answer(404, {"error": {"code": 404, "message": "no " + self.path}})
            return
        prompt = body["prompt"]
        parts = [prompt] if isinstance(prompt, str) else prompt
        first = parts[0]
        mode = first[0] if isinstance(first, str) else chr(first)
        counted = sum(len(p) if isinstance(p, str) else 1 for p in parts)
        if mode == "r" and not Engine.dropped:
            Engine.dropped = True
            self.close_connection = True
            return
        if mode == "a":
            self.answer(500, {"error": {"code": 500, "message": "scripted internal failure", "type": "server_error"}})
        elif mode == "d":
            self.answer(400, {"error": {"code": 400, "message": "scripted bad request", "type": "invalid_request_error"}})
        elif mode == "e":
            self.answer(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
        else:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            def event(obj):
                if isinstance(obj, dict):
                    obj["tokens_evaluated"] = counted
                self.wfile.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")
                self.wfile.flush()
            if mode == "b":
                event(b"{this is not json")
            elif mode == "m":
                event({"content": json.dumps(prompt), "tokens": [120], "stop": False, "tokens_predicted": 1})
                event({"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 1})
            elif mode == "p":
                said = " cache_prompt=" + json.dumps(body.get("cache_prompt"))
                event({"content": said, "tokens": [120], "stop": False, "tokens_predicted": 1})
                event({"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 1})
            else:
                event({"content": " x", "tokens": [120], "stop": False, "tokens_predicted": 1})
                event({"content": " y", "tokens": [121], "stop": False, "tokens_predicted": 2})
                if mode != "c":
                    event({"content": "", "tokens": [], "stop": True, "stop_type": "limit", "tokens_predicted": 2})
            self.close_connection = True

server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Engine)
print("scripted engine listening", flush=True)
server.serve_forever()
"#;

/// The scripted engine as a process (Python from `TOKENMESH_PYTHON`, else
/// `python3`), once it answers `/health`.
pub async fn scripted_engine(dir: &Path) -> Result<(Proc, String)> {
    let script = dir.join("scripted_engine.py");
    std::fs::write(&script, SCRIPTED_ENGINE)?;
    let python = std::env::var("TOKENMESH_PYTHON").unwrap_or_else(|_| "python3".into());
    let port = free_port();
    let args = vec![script.display().to_string(), port.to_string()];
    let proc = Proc::spawn("scripted-engine", Path::new(&python), &args, dir)?;
    let addr = format!("127.0.0.1:{port}");
    let up = eventually(Duration::from_secs(20), || {
        let addr = addr.clone();
        async move { matches!(http_get(&addr, "/health").await, Ok((200, _))) }
    })
    .await;
    if !up {
        bail!("the scripted engine did not start:\n{}", proc.log_text());
    }
    Ok((proc, format!("http://{addr}")))
}
