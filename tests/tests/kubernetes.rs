//! The Kubernetes manifests (deploy/kubernetes/, issue 19), checked without a
//! cluster: `render.py` renders them under each certificate issuer and with
//! an external etcd; `check.py` validates every object against the
//! Kubernetes OpenAPI schemas of `kubernetes-validate` (custom resources
//! against its own structural schemas), and a corrupted manifest is refused.
//! The invariants are tested on the rendered objects: every container has
//! probes, limits and a non-root user; every Secret mounted is produced by
//! the manifests (the certificate Job or cert-manager) and the model claim is
//! documented; ports are DESIGN.md's and the binaries' defaults; every
//! `TOKENMESH_*` variable is one the binary reads; a worker's version label
//! is its `--model-version`; only routers reach workers and only operators
//! the control plane; the PrometheusRule passes promtool; each worker
//! Deployment has one autoscaler (an HPA, or a KEDA ScaledObject), on series
//! a real worker exports.
//!
//! Needs the test virtualenv's python (`TOKENMESH_PYTHON`, with PyYAML and
//! kubernetes-validate: scripts/test.sh installs them), promtool, and the
//! release binaries.
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use tokenmesh_tests::bin;

fn kube_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes")
}

fn python() -> String {
    std::env::var("TOKENMESH_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Runs `script` under the test python with `args` and `stdin`; its status
/// and its stdout and stderr together.
fn run_py(script: &str, args: &[&str], stdin: &str) -> (bool, String) {
    let mut child = Command::new(python())
        .arg(kube_dir().join(script))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("TOKENMESH_PYTHON runs (the test virtualenv: scripts/test.sh)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// The variants every test covers: (what, --set overrides).
const VARIANTS: &[(&str, &[&str])] = &[
    ("certificate job", &[]),
    ("cert-manager", &["tls.issuer=cert-manager"]),
    (
        "external etcd",
        &["etcd.external=https://etcd-a:2379,https://etcd-b:2379"],
    ),
    ("KEDA", &["autoscaling.engine=keda"]),
];

fn render(sets: &[&str], format: &str) -> String {
    let mut args = vec!["--format", format];
    for s in sets {
        args.extend(["--set", s]);
    }
    let (ok, out) = run_py("render.py", &args, "");
    assert!(ok, "render.py {args:?}:\n{out}");
    out
}

fn objects(sets: &[&str]) -> Vec<Value> {
    serde_json::from_str::<Vec<Value>>(&render(sets, "json")).expect("render.py --format json")
}

fn s<'a>(v: &'a Value, path: &str) -> &'a str {
    v.pointer(path)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("{path} missing in {v}"))
}

fn name(o: &Value) -> String {
    format!("{}/{}", s(o, "/kind"), s(o, "/metadata/name"))
}

/// (object name, pod spec) of every workload.
fn pod_specs(objs: &[Value]) -> Vec<(String, &Value)> {
    objs.iter()
        .filter_map(|o| {
            let spec = match s(o, "/kind") {
                "Deployment" | "StatefulSet" | "Job" => o.pointer("/spec/template/spec"),
                _ => None,
            }?;
            Some((name(o), spec))
        })
        .collect()
}

fn list<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map_or(&[], Vec::as_slice)
}

fn env_of(c: &Value) -> BTreeMap<String, Value> {
    list(c, "env")
        .iter()
        .map(|e| (s(e, "/name").to_string(), e.clone()))
        .collect()
}

fn env_value(c: &Value, key: &str) -> Option<String> {
    env_of(c)
        .get(key)
        .and_then(|e| e.get("value").and_then(Value::as_str).map(String::from))
}

#[test]
fn every_object_passes_the_kubernetes_schemas() {
    for (what, sets) in VARIANTS {
        let yaml = render(sets, "yaml");
        let (ok, out) = run_py("check.py", &["-k", "1.31.0"], &yaml);
        assert!(ok, "{what}:\n{out}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            lines.len(),
            objects(sets).len(),
            "{what}: one line per object:\n{out}"
        );
        assert!(
            lines.iter().all(|l| l.starts_with("valid ")),
            "{what}:\n{out}"
        );
        // Core kinds went through the OpenAPI schemas, not only the custom ones.
        assert!(
            out.contains("valid Deployment/tokenmesh-router (kubernetes 1.31.0)"),
            "{out}"
        );
        assert!(out.contains("(custom schema)"), "{out}");
    }
}

#[test]
fn validation_refuses_what_kubernetes_would() {
    let yaml = render(&[], "yaml");
    for (from, to, expect) in [
        // A misspelt field of a core kind (strict schemas).
        (
            "terminationGracePeriodSeconds:",
            "terminationGracePeriodSecond:",
            "terminationGracePeriodSecond",
        ),
        // A wrong type in a core kind.
        ("minAvailable: 1", "minAvailable: {}", "PodDisruptionBudget"),
        // A custom resource's unknown field.
        ("jobLabel:", "jobLabels:", "ServiceMonitor"),
    ] {
        assert!(yaml.contains(from), "{from}");
        let (ok, out) = run_py("check.py", &[], &yaml.replacen(from, to, 1));
        assert!(!ok, "{to} was accepted:\n{out}");
        let bad: Vec<&str> = out.lines().filter(|l| l.starts_with("INVALID")).collect();
        assert_eq!(bad.len(), 1, "{out}");
        assert!(bad[0].contains(expect), "{bad:?}");
    }
}

#[test]
fn unknown_values_are_refused_with_their_name() {
    let (ok, out) = run_py("render.py", &["--set", "router.replica=2"], "");
    assert!(!ok);
    assert!(out.contains("router.replica: no such value"), "{out}");
    let (ok, out) = run_py("render.py", &["--set", "tls.issuer=vault"], "");
    assert!(!ok);
    assert!(out.contains("tls.issuer"), "{out}");
}

#[test]
fn every_container_has_probes_limits_and_a_non_root_user() {
    for (what, sets) in VARIANTS {
        let objs = objects(sets);
        let specs = pod_specs(&objs);
        assert!(specs.len() >= 5, "{what}: {}", specs.len());
        for (obj, spec) in specs {
            let pod_sc = &spec["securityContext"];
            assert_eq!(pod_sc["runAsNonRoot"], true, "{what} {obj}");
            let long_running = !obj.starts_with("Job/");
            let init = list(spec, "initContainers").iter().map(|c| (c, false));
            for (c, main) in list(spec, "containers")
                .iter()
                .map(|c| (c, true))
                .chain(init)
            {
                let at = format!("{what} {obj} container {}", s(c, "/name"));
                let sc = &c["securityContext"];
                assert_eq!(sc["runAsNonRoot"], true, "{at}");
                assert_ne!(sc["runAsUser"].as_u64().unwrap_or(0), 0, "{at}");
                assert_eq!(sc["allowPrivilegeEscalation"], false, "{at}");
                for kind in ["requests", "limits"] {
                    for res in ["cpu", "memory"] {
                        assert!(c["resources"][kind][res].is_string(), "{at}: {kind}.{res}");
                    }
                }
                // Init containers and Jobs run to completion: kubelet allows
                // no readiness probe there and a liveness probe means nothing.
                if long_running && main {
                    for p in ["startupProbe", "livenessProbe", "readinessProbe"] {
                        assert!(c[p].is_object(), "{at}: {p}");
                    }
                }
            }
        }
    }
}

/// Secrets the manifests produce: the certificate Job's `kubectl create
/// secret` lines, or cert-manager Certificates.
fn produced_secrets(objs: &[Value]) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for o in objs {
        match s(o, "/kind") {
            "Certificate" => {
                out.insert(s(o, "/spec/secretName").to_string());
            }
            "Job" => {
                for c in list(&o["spec"]["template"]["spec"], "containers") {
                    for line in list(c, "command").iter().filter_map(Value::as_str) {
                        for l in line.lines() {
                            if let Some(rest) = l.strip_prefix("kubectl create secret generic ") {
                                out.insert(rest.split(' ').next().unwrap().to_string());
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    out
}

#[test]
fn every_mounted_secret_is_produced_and_every_claim_documented() {
    let readme = std::fs::read_to_string(kube_dir().join("../../README.md")).unwrap();
    for (what, sets) in VARIANTS {
        let objs = objects(sets);
        let produced = produced_secrets(&objs);
        assert!(produced.contains("tokenmesh-ca"), "{what}: {produced:?}");
        let issuers: BTreeSet<&str> = objs
            .iter()
            .filter(|o| s(o, "/kind") == "Issuer")
            .map(|o| s(o, "/metadata/name"))
            .collect();
        for o in objs.iter().filter(|o| s(o, "/kind") == "Issuer") {
            if let Some(secret) = o.pointer("/spec/ca/secretName") {
                assert!(
                    produced.contains(secret.as_str().unwrap()),
                    "{what}: {secret}"
                );
            }
        }
        let mut mounted = 0;
        for (obj, spec) in pod_specs(&objs) {
            for vol in list(spec, "volumes") {
                if let Some(secret) = vol.pointer("/secret/secretName") {
                    mounted += 1;
                    let secret = secret.as_str().unwrap();
                    assert!(
                        produced.contains(secret),
                        "{what} {obj}: {secret} is produced by nothing ({produced:?})"
                    );
                }
                if let Some(csi) = vol.get("csi") {
                    // Per-pod worker certificates come off a rendered Issuer.
                    assert_eq!(s(csi, "/driver"), "csi.cert-manager.io", "{obj}");
                    let attrs = &csi["volumeAttributes"];
                    assert!(
                        issuers.contains(s(attrs, "/csi.cert-manager.io~1issuer-name")),
                        "{obj}"
                    );
                    assert_eq!(
                        s(attrs, "/csi.cert-manager.io~1uri-sans"),
                        "spiffe://tokenmesh/worker/${POD_NAME}",
                        "{obj}: the worker id is the pod's name"
                    );
                }
                if let Some(claim) = vol.pointer("/persistentVolumeClaim/claimName") {
                    let claim = claim.as_str().unwrap();
                    assert!(
                        readme.contains(claim),
                        "{obj}: claim {claim} is not documented in README.md"
                    );
                }
            }
        }
        // router, control plane, policy Job (and etcd when it is ours)
        assert!(mounted >= 3, "{what}: {mounted}");
    }
}

/// DESIGN.md, "Processes": (role, port name, port).
const DESIGN_PORTS: &[(&str, &str, u16)] = &[
    ("router", "grpc", 50051),
    ("router", "http", 8080),
    ("router", "metrics", 9464),
    ("worker", "grpc", 50061),
    ("worker", "metrics", 9465),
    ("control", "grpc", 50071),
    ("control", "metrics", 9466),
];

fn help(binary: &str) -> String {
    let out = Command::new(bin(binary)).arg("--help").output().unwrap();
    assert!(out.status.success(), "{binary} --help");
    String::from_utf8(out.stdout).unwrap()
}

/// The main container of each tokenmesh process: (role, container).
fn processes(objs: &[Value]) -> Vec<(String, Value)> {
    pod_specs(objs)
        .into_iter()
        .filter(|(obj, _)| obj.starts_with("Deployment/"))
        .map(|(_, spec)| {
            let c = list(spec, "containers")[0].clone();
            (s(&c, "/name").to_string(), c)
        })
        .collect()
}

#[test]
fn ports_are_designs_and_every_variable_is_read_by_its_binary() {
    let objs = objects(&[]);
    let procs = processes(&objs);
    assert_eq!(
        procs
            .iter()
            .map(|(r, _)| r.as_str())
            .collect::<BTreeSet<_>>(),
        ["control", "router", "worker"].into()
    );
    for (role, c) in &procs {
        let binary = format!("tokenmesh-{role}");
        let help = help(&binary);
        let ports: BTreeMap<&str, u64> = list(c, "ports")
            .iter()
            .map(|p| (s(p, "/name"), p["containerPort"].as_u64().unwrap()))
            .collect();
        for (r, port_name, port) in DESIGN_PORTS.iter().filter(|(r, ..)| r == role) {
            assert_eq!(
                ports.get(port_name),
                Some(&u64::from(*port)),
                "{r} {port_name}"
            );
        }
        // The gRPC port is the binary's own default too.
        assert!(
            help.contains(&format!("[default: 0.0.0.0:{}]", ports["grpc"])),
            "{binary}'s --listen default is not {}",
            ports["grpc"]
        );
        assert_eq!(
            env_value(c, "TOKENMESH_LISTEN").unwrap(),
            format!("0.0.0.0:{}", ports["grpc"])
        );
        assert_eq!(
            env_value(c, "TOKENMESH_METRICS_LISTEN").unwrap(),
            format!("0.0.0.0:{}", ports["metrics"])
        );
        if let Some(http) = env_value(c, "TOKENMESH_HTTP_LISTEN") {
            assert_eq!(http, format!("0.0.0.0:{}", ports["http"]));
        }
        // A misspelt variable would be ignored silently by the binary.
        for key in env_of(c).keys().filter(|k| k.starts_with("TOKENMESH_")) {
            assert!(
                help.contains(&format!("[env: {key}=")),
                "{binary} reads no {key}"
            );
        }
        // Probes ask the plaintext metrics listener.
        for p in ["startupProbe", "livenessProbe", "readinessProbe"] {
            assert_eq!(c[p]["httpGet"]["port"], "metrics", "{role} {p}");
        }
        assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
        assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    }
    // Every Service port targets a port its pods declare.
    for svc in objs.iter().filter(|o| s(o, "/kind") == "Service") {
        let component = s(svc, "/spec/selector/app.kubernetes.io~1component");
        let declared: BTreeSet<String> = pod_specs(&objs)
            .iter()
            .filter(|(_, spec)| {
                list(spec, "containers")
                    .iter()
                    .any(|c| c["name"] == component)
            })
            .flat_map(|(_, spec)| list(&list(spec, "containers")[0], "ports").to_vec())
            .map(|p| s(&p, "/name").to_string())
            .collect();
        for p in list(&svc["spec"], "ports") {
            assert!(declared.contains(s(p, "/targetPort")), "{}: {p}", name(svc));
        }
    }
}

#[test]
fn router_rebalances_clients_and_workers_get_time_to_drain() {
    let objs = objects(&[]);
    let router_help = help("tokenmesh-router");
    let worker_help = help("tokenmesh-worker");
    for (obj, spec) in pod_specs(&objs) {
        let c = &list(spec, "containers")[0];
        let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
        if c["name"] == "router" {
            assert!(router_help.contains("--max-connection-age-s"));
            let age: u64 = env_value(c, "TOKENMESH_MAX_CONNECTION_AGE_S")
                .unwrap()
                .parse()
                .unwrap();
            assert!(age > 0, "{obj}: routers must close old client connections");
            let age_grace: u64 = env_value(c, "TOKENMESH_MAX_CONNECTION_AGE_GRACE_S")
                .unwrap()
                .parse()
                .unwrap();
            let pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
                .as_u64()
                .unwrap();
            assert!(grace >= pre_stop + age_grace, "{obj}: {grace}");
        }
        if c["name"] == "worker" {
            // SIGTERM starts the worker's drain; kubelet must not kill it
            // before --drain-timeout has passed.
            assert!(worker_help.contains("[env: TOKENMESH_DRAIN_TIMEOUT="));
            let drain: u64 = env_value(c, "TOKENMESH_DRAIN_TIMEOUT")
                .unwrap()
                .parse()
                .unwrap();
            assert!(grace > drain, "{obj}: grace {grace} <= drain {drain}");
        }
    }
}

#[test]
fn a_workers_version_label_is_its_model_version() {
    let objs = objects(&[]);
    let workers: Vec<&Value> = objs
        .iter()
        .filter(|o| {
            s(o, "/kind") == "Deployment" && s(o, "/metadata/name").starts_with("tokenmesh-worker-")
        })
        .collect();
    assert_eq!(
        workers.len(),
        2,
        "one Deployment per version (values.yaml: v1, v2)"
    );
    let mut versions = BTreeSet::new();
    for d in workers {
        let label = s(d, "/spec/template/metadata/labels/tokenmesh.io~1version");
        assert_eq!(s(d, "/metadata/name"), format!("tokenmesh-worker-{label}"));
        assert_eq!(
            s(d, "/spec/selector/matchLabels/tokenmesh.io~1version"),
            label
        );
        let c = &list(&d["spec"]["template"]["spec"], "containers")[0];
        let env = env_of(c);
        assert_eq!(
            s(
                &env["TOKENMESH_MODEL_VERSION"],
                "/valueFrom/fieldRef/fieldPath"
            ),
            "metadata.labels['tokenmesh.io/version']"
        );
        versions.insert(label.to_string());
    }
    assert_eq!(versions, ["v1".to_string(), "v2".to_string()].into());
    // The worker reads it as its --model-version.
    assert!(help("tokenmesh-worker").contains("[env: TOKENMESH_MODEL_VERSION="));
}

#[test]
fn only_routers_reach_workers_and_only_operators_the_control_plane() {
    let objs = objects(&[]);
    let policy = |component: &str| {
        objs.iter()
            .find(|o| {
                s(o, "/kind") == "NetworkPolicy"
                    && o["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                        == component
            })
            .unwrap_or_else(|| panic!("no NetworkPolicy for {component}"))
            .clone()
    };
    let rules_for = |p: &Value, port: &str| -> Vec<Value> {
        list(&p["spec"], "ingress")
            .iter()
            .filter(|r| list(r, "ports").iter().any(|x| x["port"] == port))
            .flat_map(|r| list(r, "from").to_vec())
            .collect()
    };
    let worker = rules_for(&policy("worker"), "grpc");
    assert_eq!(worker.len(), 1, "{worker:?}");
    assert_eq!(
        worker[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"],
        "router"
    );
    assert!(
        worker[0].get("namespaceSelector").is_none(),
        "routers of this namespace only"
    );
    let control = rules_for(&policy("control"), "grpc");
    assert_eq!(control.len(), 1, "{control:?}");
    assert_eq!(
        control[0]["podSelector"]["matchLabels"]["tokenmesh.io/operator"],
        "true"
    );
    // Everything else is denied by default.
    let deny = objs
        .iter()
        .find(|o| s(o, "/metadata/name") == "tokenmesh-default-deny")
        .unwrap();
    assert!(deny["spec"].get("ingress").is_none());
}

#[test]
fn the_prometheus_rule_passes_promtool() {
    let objs = objects(&[]);
    let rule = objs
        .iter()
        .find(|o| s(o, "/kind") == "PrometheusRule")
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("rules.json");
    // JSON is YAML: promtool reads the spec as a rule file.
    std::fs::write(&path, serde_json::to_string(&rule["spec"]).unwrap()).unwrap();
    let out = Command::new("promtool")
        .args(["check", "rules"])
        .arg(&path)
        .output()
        .expect("promtool is installed (scripts/test.sh installs it)");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    // The alerts and the recording rules of deploy/prometheus, all of them.
    assert!(text.contains("SUCCESS: 11 rules found"), "{text}");
}

/// `TOKENMESH_TEST_MODEL` is the default model file the workers mount: its
/// memory limit holds at least the file's weights and the KV budget.
#[test]
fn a_workers_memory_covers_its_model_and_kv_budget() {
    let model = PathBuf::from(
        std::env::var("TOKENMESH_TEST_MODEL").expect("TOKENMESH_TEST_MODEL: the default model"),
    );
    let file_mib = std::fs::metadata(&model).unwrap().len().div_ceil(1 << 20);
    let objs = objects(&[]);
    let mut checked = 0;
    for (obj, spec) in pod_specs(&objs) {
        let c = &list(spec, "containers")[0];
        if c["name"] != "worker" {
            continue;
        }
        let path = env_value(c, "TOKENMESH_MODEL").unwrap();
        assert_eq!(
            Some(model.file_name().unwrap().to_str().unwrap()),
            path.strip_prefix("/models/")
        );
        let kv: u64 = env_value(c, "TOKENMESH_KV_BUDGET_MIB")
            .unwrap()
            .parse()
            .unwrap();
        for kind in ["requests", "limits"] {
            let mem = s(&c["resources"][kind], "/memory");
            let mib: u64 = mem.strip_suffix("Mi").unwrap().parse().unwrap();
            assert!(
                mib >= file_mib + kv,
                "{obj} {kind} {mem} < {file_mib} MiB model + {kv} MiB KV"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 2);
}

/// Series name → label names → values, of a scrape's text.
fn exported(text: &str) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    let lines = text.lines().map(|l| Ok(l.to_string()));
    for sample in prometheus_parse::Scrape::parse(lines).unwrap().samples {
        let labels = out.entry(sample.metric).or_default();
        for (k, v) in sample.labels.iter() {
            labels.entry(k.clone()).or_default().insert(v.clone());
        }
    }
    out
}

/// `name{k="v",...}` in a PromQL query: the metric and its matchers.
fn selectors(query: &str) -> Vec<(String, BTreeMap<String, String>)> {
    let mut out = Vec::new();
    let mut rest = query;
    while let Some(open) = rest.find('{') {
        let name: String = rest[..open]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        let close = open + rest[open..].find('}').expect("a closed selector");
        let matchers = rest[open + 1..close]
            .split(',')
            .map(|m| {
                let (k, v) = m.split_once('=').expect("k=\"v\" matchers only");
                (k.to_string(), v.trim_matches('"').to_string())
            })
            .collect();
        out.push((name, matchers));
        rest = &rest[close + 1..];
    }
    out
}

/// Every worker Deployment has exactly one autoscaler, an HPA or (with
/// `autoscaling.engine=keda`) a KEDA ScaledObject, targeting it with the
/// bounds of its values; each metric it reads is one a real worker of that
/// version exports. ScaledObject is a custom resource: kubernetes-validate has
/// no schema for it, so check.py holds a structural one (not KEDA's CRD) and
/// its meaning is checked here.
#[tokio::test(flavor = "multi_thread")]
async fn each_worker_version_autoscales_on_series_its_workers_export() {
    use tokenmesh_tests::{free_port, scrape_text, WorkerOpts, WorkerProc, MODEL};
    let dir = tempfile::tempdir().unwrap();
    let metrics = format!("127.0.0.1:{}", free_port());
    let opts = WorkerOpts {
        extra: vec![
            "--model-name".into(),
            MODEL.into(),
            "--metrics-listen".into(),
            metrics.clone(),
        ],
        synthetic_tokens_per_sec: Some(100.0),
        ..WorkerOpts::new("w-metrics")
    };
    let worker = WorkerProc::start(opts, dir.path())
        .await
        .expect("worker starts");
    // The worker publishes its engine's gauges once its loop has turned:
    // one request makes it.
    let mut wc = worker.client().await;
    let call = tokenmesh_proto::v1::WorkerGenerateRequest {
        request: Some(tokenmesh_tests::prompt_request("scale", 2)),
        ..Default::default()
    };
    let mut stream = wc
        .generate(call)
        .await
        .expect("the worker serves")
        .into_inner();
    while stream
        .message()
        .await
        .expect("the stream ends well")
        .is_some()
    {}
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let series = loop {
        let series = exported(&scrape_text(&metrics).await.unwrap_or_default());
        if series.contains_key("llm_queue_depth") || std::time::Instant::now() > deadline {
            break series;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert!(
        series.contains_key("llm_queue_depth"),
        "the worker exports no llm_queue_depth: {series:?}"
    );
    // Its version label is its --model-version (v1 here).
    assert!(
        series["llm_queue_depth"]["version"].contains("v1"),
        "{series:?}"
    );

    for (engine, sets, kind) in [
        ("hpa", &[][..], "HorizontalPodAutoscaler"),
        ("keda", &["autoscaling.engine=keda"][..], "ScaledObject"),
    ] {
        let objs = objects(sets);
        let values = values_yaml();
        let namespace = values["namespace"].as_str().unwrap();
        let worker_job = objs
            .iter()
            .find(|o| {
                s(o, "/kind") == "ServiceMonitor" && s(o, "/metadata/name") == "tokenmesh-worker"
            })
            .map(|o| s(o, "/spec/selector/matchLabels/tokenmesh.io~1job").to_string())
            .expect("a worker ServiceMonitor");
        let deployments: BTreeSet<String> = objs
            .iter()
            .filter(|o| {
                s(o, "/kind") == "Deployment"
                    && s(o, "/metadata/labels/app.kubernetes.io~1component") == "worker"
            })
            .map(|o| s(o, "/metadata/name").to_string())
            .collect();
        let scalers: Vec<&Value> = objs
            .iter()
            .filter(|o| matches!(s(o, "/kind"), "HorizontalPodAutoscaler" | "ScaledObject"))
            .collect();
        assert!(
            scalers.iter().all(|o| s(o, "/kind") == kind),
            "{engine}: only {kind}s"
        );
        let targets: BTreeSet<String> = scalers
            .iter()
            .map(|o| s(o, "/spec/scaleTargetRef/name").to_string())
            .collect();
        assert_eq!(
            targets, deployments,
            "{engine}: one autoscaler per worker Deployment"
        );
        assert_eq!(scalers.len(), deployments.len(), "{engine}");
        for o in scalers {
            let at = format!("{engine} {}", name(o));
            assert_eq!(s(o, "/spec/scaleTargetRef/kind"), "Deployment", "{at}");
            let version = s(o, "/metadata/labels/tokenmesh.io~1version");
            let w = values["workers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|w| w["version"] == version)
                .unwrap();
            let (min, max) = match kind {
                "ScaledObject" => ("/spec/minReplicaCount", "/spec/maxReplicaCount"),
                _ => ("/spec/minReplicas", "/spec/maxReplicas"),
            };
            assert_eq!(o.pointer(min), w.pointer("/autoscale/min"), "{at}");
            assert_eq!(o.pointer(max), w.pointer("/autoscale/max"), "{at}");
            if kind == "HorizontalPodAutoscaler" {
                for m in list(&o["spec"], "metrics") {
                    let metric = s(m, "/pods/metric/name");
                    assert!(
                        series.contains_key(metric),
                        "{at}: the worker exports no {metric}"
                    );
                }
                continue;
            }
            let triggers = list(&o["spec"], "triggers");
            assert_eq!(triggers.len(), 1, "{at}");
            let t = &triggers[0];
            assert_eq!(s(t, "/type"), "prometheus", "{at}");
            assert_eq!(
                s(t, "/metadata/threshold"),
                w["autoscale"]["queueDepth"].to_string(),
                "{at}"
            );
            let query = s(t, "/metadata/query");
            let sel = selectors(query);
            assert_eq!(sel.len(), 1, "{at}: {query}");
            let (metric, matchers) = &sel[0];
            assert_eq!(metric, "llm_queue_depth", "{at}: {query}");
            let labels = &series[metric.as_str()];
            for (k, v) in matchers {
                match k.as_str() {
                    // Added by Prometheus: the ServiceMonitor's jobLabel and
                    // the pod's namespace.
                    "job" => assert_eq!(v, &worker_job, "{at}: {query}"),
                    "namespace" => assert_eq!(v, namespace, "{at}: {query}"),
                    // The worker's own label, the version it serves.
                    "version" => {
                        assert_eq!(v, version, "{at}: {query}");
                        assert!(labels.contains_key("version"), "{at}: {labels:?}");
                    }
                    other => assert!(
                        labels.contains_key(other),
                        "{at}: no label {other} in {labels:?}"
                    ),
                }
            }
        }
    }
}

/// values.yaml as JSON.
fn values_yaml() -> Value {
    let py = format!(
        "import json, yaml; print(json.dumps(yaml.safe_load(open({:?}).read())))",
        kube_dir().join("values.yaml").display().to_string()
    );
    let out = Command::new(python()).args(["-c", &py]).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
