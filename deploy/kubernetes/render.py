#!/usr/bin/env python3
"""Renders the tokenmesh Kubernetes manifests from values.yaml.

    python3 deploy/kubernetes/render.py [--values FILE] [--set KEY=VALUE]... [--format yaml|json]

writes plain manifests to stdout (`| kubectl apply -f -`). Plain Python
instead of a Helm chart: no helm binary is needed to render or to test, the
objects are built as data (no text templating to mis-indent), and each part
of the mesh is one function below. Needs PyYAML. deploy/kubernetes/check.py
validates the output; tests/tests/kubernetes.rs tests its invariants.
"""
import argparse
import copy
import json
import math
import pathlib
import sys

import yaml

HERE = pathlib.Path(__file__).resolve().parent
DEPLOY = HERE.parent

# DESIGN.md, "Processes".
PORTS = {
    "router": {"grpc": 50051, "http": 8080, "metrics": 9464},
    "worker": {"grpc": 50061, "metrics": 9465},
    "control": {"grpc": 50071, "metrics": 9466},
    "etcd": {"client": 2379, "peer": 2380, "metrics": 2381},
}
# The image's unprivileged user (deploy/Dockerfile).
UID = 10001
CERTS = "/certs"
PART_OF = {"app.kubernetes.io/part-of": "tokenmesh"}


class ValuesError(Exception):
    pass


def load_values(path, overrides):
    values = yaml.safe_load(pathlib.Path(path).read_text())
    defaults = yaml.safe_load((HERE / "values.yaml").read_text())
    check_keys(defaults, values, "")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValuesError(f"--set {item}: expected KEY=VALUE")
        node = values
        parts = key.split(".")
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                raise ValuesError(f"--set {key}: {p} is not a section of the values")
            node = node[p]
        if parts[-1] not in node:
            raise ValuesError(f"--set {key}: no such value (see deploy/kubernetes/values.yaml)")
        node[parts[-1]] = yaml.safe_load(raw)
    if values["tls"]["issuer"] not in ("job", "cert-manager"):
        raise ValuesError("tls.issuer: job or cert-manager")
    if values["autoscaling"]["engine"] not in ("hpa", "keda"):
        raise ValuesError("autoscaling.engine: hpa or keda")
    versions = [w["version"] for w in values["workers"]]
    if len(set(versions)) != len(versions):
        raise ValuesError(f"workers: each version once, got {versions}")
    return values


def check_keys(ref, got, at):
    """Every key of `got` is one values.yaml has (workers: as its first)."""
    if isinstance(ref, dict):
        if not isinstance(got, dict):
            raise ValuesError(f"{at or 'values'}: expected a mapping")
        for k, v in got.items():
            if k not in ref:
                raise ValuesError(f"{at}{k}: unknown value (see deploy/kubernetes/values.yaml)")
            check_keys(ref[k], v, f"{at}{k}.")
    elif isinstance(ref, list) and ref and isinstance(ref[0], dict):
        if not isinstance(got, list):
            raise ValuesError(f"{at[:-1]}: expected a list")
        for i, item in enumerate(got):
            check_keys(ref[0], item, f"{at[:-1]}[{i}].")


def meta(name, v, component, extra_labels=None):
    labels = {**PART_OF, "app.kubernetes.io/name": name, "app.kubernetes.io/component": component}
    labels.update(extra_labels or {})
    return {"name": name, "namespace": v["namespace"], "labels": labels}


def selector(component, extra=None):
    return {**PART_OF, "app.kubernetes.io/component": component, **(extra or {})}


def worker_memory_mib(w):
    """memory = model weights in memory + the KV pool + process overhead."""
    mib = math.ceil(w["fileMiB"] * w["weightFactor"]) + w["kvBudgetMiB"] + w["overheadMiB"]
    return 64 * math.ceil(mib / 64)


def resources(cpu, memory_mib):
    r = {"cpu": str(cpu), "memory": f"{memory_mib}Mi"}
    return {"requests": dict(r), "limits": dict(r)}


def security():
    return {
        "runAsNonRoot": True,
        "runAsUser": UID,
        "runAsGroup": UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_env():
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NO_COLOR", "value": "1"},
    ]


def http_probe(path, port, period, failures):
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def probes(port, ready_failures=3, start_failures=30):
    """/healthz and /readyz on the plaintext metrics listener: kubelet cannot
    present a mesh client certificate to the gRPC port."""
    return {
        "startupProbe": http_probe("/healthz", port, 2, start_failures),
        "livenessProbe": http_probe("/healthz", port, 10, 3),
        "readinessProbe": http_probe("/readyz", port, 2, ready_failures),
    }


def etcd_urls(v):
    if v["etcd"]["external"]:
        return v["etcd"]["external"]
    ns = v["namespace"]
    return ",".join(
        f"https://tokenmesh-etcd-{i}.tokenmesh-etcd.{ns}.svc:{PORTS['etcd']['client']}"
        for i in range(v["etcd"]["replicas"])
    )


def mesh_env(v, role):
    return pod_env() + [
        {"name": "TOKENMESH_ETCD", "value": etcd_urls(v)},
        {"name": "TOKENMESH_TLS_DIR", "value": CERTS},
        {"name": "TOKENMESH_LISTEN", "value": f"0.0.0.0:{PORTS[role]['grpc']}"},
        {"name": "TOKENMESH_METRICS_LISTEN", "value": f"0.0.0.0:{PORTS[role]['metrics']}"},
        {"name": "TOKENMESH_LOG_FORMAT", "value": "json"},
    ]


def secret_volume(secret):
    return {"name": "certs", "secret": {"secretName": secret, "defaultMode": 0o440}}


def certs_mount():
    return {"name": "certs", "mountPath": CERTS, "readOnly": True}


def anti_affinity(component, required):
    term = {
        "labelSelector": {"matchLabels": selector(component)},
        "topologyKey": "kubernetes.io/hostname",
    }
    if required:
        return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]
        }
    }


def pod_spec(containers, volumes, grace, affinity=None, init=None, sa=None, restart=None):
    spec = {
        "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID},
        "terminationGracePeriodSeconds": grace,
        "automountServiceAccountToken": sa is not None,
        "containers": containers,
        "volumes": volumes,
    }
    if sa:
        spec["serviceAccountName"] = sa
    if affinity:
        spec["affinity"] = affinity
    if init:
        spec["initContainers"] = init
    if restart:
        spec["restartPolicy"] = restart
    return spec


def container(name, v, args, env, ports, res, mounts, extra=None):
    c = {
        "name": name,
        "image": v["image"],
        "imagePullPolicy": v["imagePullPolicy"],
        "args": args,
        "env": env,
        "ports": [{"name": n, "containerPort": p} for n, p in ports.items()],
        "resources": res,
        "securityContext": security(),
        "volumeMounts": mounts,
    }
    c.update(extra or {})
    return c


def tmp_volume():
    return {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}


def tmp_mount():
    return {"name": "tmp", "mountPath": "/tmp"}


def deployment(name, v, component, replicas, spec, labels=None):
    sel = selector(component, labels)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, v, component, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": sel},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": {**meta(name, v, component, labels)["labels"]}}, "spec": spec},
        },
    }


def pdb(name, v, component, labels=None, min_available=None, max_unavailable=None):
    spec = {"selector": {"matchLabels": selector(component, labels)}}
    if min_available is not None:
        spec["minAvailable"] = min_available
    else:
        spec["maxUnavailable"] = max_unavailable
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(name, v, component, labels), "spec": spec}


def service(name, v, component, ports, headless=False, svc_type="ClusterIP", labels=None):
    spec = {
        "selector": selector(component),
        "ports": [{"name": n, "port": p, "targetPort": n} for n, p in ports.items()],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True
    else:
        spec["type"] = svc_type
    m = meta(name, v, component, labels)
    m["labels"]["tokenmesh.io/job"] = component
    return {"apiVersion": "v1", "kind": "Service", "metadata": m, "spec": spec}


# --- etcd -------------------------------------------------------------------


def etcd(v):
    if v["etcd"]["external"]:
        return []
    e, ns, n = v["etcd"], v["namespace"], v["etcd"]["replicas"]
    p = PORTS["etcd"]
    peers = ",".join(
        f"tokenmesh-etcd-{i}=https://tokenmesh-etcd-{i}.tokenmesh-etcd.{ns}.svc:{p['peer']}" for i in range(n)
    )
    host = f"$(POD_NAME).tokenmesh-etcd.{ns}.svc"
    env = pod_env() + [
        {"name": "ETCD_NAME", "value": "$(POD_NAME)"},
        {"name": "ETCD_DATA_DIR", "value": "/etcd-data/member"},
        {"name": "ETCD_LISTEN_CLIENT_URLS", "value": f"https://0.0.0.0:{p['client']}"},
        {"name": "ETCD_LISTEN_PEER_URLS", "value": f"https://0.0.0.0:{p['peer']}"},
        # Plaintext /health and /metrics for kubelet and Prometheus.
        {"name": "ETCD_LISTEN_METRICS_URLS", "value": f"http://0.0.0.0:{p['metrics']}"},
        {"name": "ETCD_ADVERTISE_CLIENT_URLS", "value": f"https://{host}:{p['client']}"},
        {"name": "ETCD_INITIAL_ADVERTISE_PEER_URLS", "value": f"https://{host}:{p['peer']}"},
        {"name": "ETCD_INITIAL_CLUSTER", "value": peers},
        {"name": "ETCD_INITIAL_CLUSTER_STATE", "value": "new"},
        {"name": "ETCD_INITIAL_CLUSTER_TOKEN", "value": f"tokenmesh-{ns}"},
        {"name": "ETCD_CLIENT_CERT_AUTH", "value": "true"},
        {"name": "ETCD_PEER_CLIENT_CERT_AUTH", "value": "true"},
    ]
    for prefix in ("", "PEER_"):
        env += [
            {"name": f"ETCD_{prefix}CERT_FILE", "value": f"{CERTS}/tls.crt"},
            {"name": f"ETCD_{prefix}KEY_FILE", "value": f"{CERTS}/tls.key"},
            {"name": f"ETCD_{prefix}TRUSTED_CA_FILE", "value": f"{CERTS}/ca.crt"},
        ]
    c = container(
        "etcd",
        v,
        ["etcd"],
        env,
        p,
        resources(e["cpu"], e["memoryMiB"]),
        [certs_mount(), {"name": "data", "mountPath": "/etcd-data"}],
        {
            "readinessProbe": http_probe("/health", "metrics", 5, 3),
            # A member without quorum is not dead: liveness only asks that it answers.
            "livenessProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 10, "failureThreshold": 6},
            "startupProbe": {"tcpSocket": {"port": "client"}, "periodSeconds": 2, "failureThreshold": 60},
        },
    )
    claim = {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": e["storage"]}}},
    }
    if e["storageClassName"]:
        claim["spec"]["storageClassName"] = e["storageClassName"]
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta("tokenmesh-etcd", v, "etcd"),
        "spec": {
            "serviceName": "tokenmesh-etcd",
            "replicas": n,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector("etcd")},
            "template": {
                "metadata": {"labels": meta("tokenmesh-etcd", v, "etcd")["labels"]},
                "spec": pod_spec([c], [secret_volume("tokenmesh-etcd-tls")], 30, anti_affinity("etcd", True)),
            },
            "volumeClaimTemplates": [claim],
        },
    }
    return [
        service("tokenmesh-etcd", v, "etcd", p, headless=True),
        sts,
        pdb("tokenmesh-etcd", v, "etcd", max_unavailable=1),
    ]


# --- routers, control plane, workers ----------------------------------------


def router(v):
    r, p = v["router"], PORTS["router"]
    env = mesh_env(v, "router") + [
        {"name": "TOKENMESH_ROUTER_ID", "value": "$(POD_NAME)"},
        {"name": "TOKENMESH_HTTP_LISTEN", "value": f"0.0.0.0:{p['http']}"},
        {"name": "TOKENMESH_MAX_CONNECTION_AGE_S", "value": str(r["maxConnectionAgeS"])},
        {"name": "TOKENMESH_MAX_CONNECTION_AGE_GRACE_S", "value": str(r["maxConnectionAgeGraceS"])},
    ]
    # preStop: the Service drops a terminating pod's endpoint asynchronously;
    # keep accepting for a few seconds so no client dials a closed port.
    extra = {**probes("metrics"), "lifecycle": {"preStop": {"sleep": {"seconds": 5}}}}
    c = container(
        "router", v, ["tokenmesh-router"], env, p, resources(r["cpu"], r["memoryMiB"]), [certs_mount(), tmp_mount()], extra
    )
    grace = 5 + r["maxConnectionAgeGraceS"]
    spec = pod_spec([c], [secret_volume("tokenmesh-router-tls"), tmp_volume()], grace, anti_affinity("router", False))
    return [
        deployment("tokenmesh-router", v, "router", r["replicas"], spec),
        service("tokenmesh-router", v, "router", p, svc_type=r["serviceType"]),
        pdb("tokenmesh-router", v, "router", min_available=1),
    ]


def control(v):
    c_, p = v["control"], PORTS["control"]
    env = mesh_env(v, "control") + [{"name": "TOKENMESH_CONTROL_ID", "value": "$(POD_NAME)"}]
    c = container(
        "control", v, ["tokenmesh-control"], env, p, resources(c_["cpu"], c_["memoryMiB"]), [certs_mount(), tmp_mount()], probes("metrics")
    )
    spec = pod_spec([c], [secret_volume("tokenmesh-control-tls"), tmp_volume()], 15, anti_affinity("control", False))
    return [
        deployment("tokenmesh-control", v, "control", c_["replicas"], spec),
        service("tokenmesh-control", v, "control", p),
        pdb("tokenmesh-control", v, "control", min_available=1),
    ]


def worker_csi(v, w):
    """The pod's own certificate, spiffe://tokenmesh/worker/<pod name>: a
    worker's id is its certificate's name, and routers check a worker's
    certificate against its registration, so pods of one Deployment cannot
    share one Secret."""
    return {
        "name": "certs",
        "csi": {
            "driver": "csi.cert-manager.io",
            "readOnly": True,
            "volumeAttributes": {
                "csi.cert-manager.io/issuer-name": "tokenmesh-ca",
                "csi.cert-manager.io/issuer-kind": "Issuer",
                "csi.cert-manager.io/common-name": "${POD_NAME}",
                "csi.cert-manager.io/uri-sans": "spiffe://tokenmesh/worker/${POD_NAME}",
                "csi.cert-manager.io/dns-names": "${POD_NAME}.${POD_NAMESPACE}",
                "csi.cert-manager.io/duration": v["tls"]["workerDuration"],
                "csi.cert-manager.io/key-usages": "server auth,client auth,digital signature,key encipherment",
                "csi.cert-manager.io/fs-group": str(UID),
            },
        },
    }


def worker(v, w):
    p, ver = PORTS["worker"], w["version"]
    name = f"tokenmesh-worker-{ver}"
    labels = {"tokenmesh.io/version": ver, "tokenmesh.io/model": v["model"]["name"]}
    env = mesh_env(v, "worker") + [
        {"name": "TOKENMESH_MODEL", "value": f"/models/{w['file']}"},
        {"name": "TOKENMESH_MODEL_NAME", "value": v["model"]["name"]},
        # The version is the pod's label, so the label selectors, dashboards
        # and the routing policy cannot disagree.
        {
            "name": "TOKENMESH_MODEL_VERSION",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['tokenmesh.io/version']"}},
        },
        {"name": "TOKENMESH_ADVERTISE", "value": f"$(POD_IP):{p['grpc']}"},
        {"name": "TOKENMESH_THREADS", "value": str(w["threads"])},
        {"name": "TOKENMESH_KV_BUDGET_MIB", "value": str(w["kvBudgetMiB"])},
        {"name": "TOKENMESH_DRAIN_TIMEOUT", "value": str(w["drainTimeoutS"])},
    ]
    mounts = [certs_mount(), {"name": "models", "mountPath": "/models", "readOnly": True}, tmp_mount()]
    c = container(
        "worker", v, ["tokenmesh-worker"], env, p, resources(w["threads"], worker_memory_mib(w)), mounts,
        probes("metrics", ready_failures=2, start_failures=150),
    )
    volumes = [
        worker_csi(v, w),
        {"name": "models", "persistentVolumeClaim": {"claimName": v["model"]["claimName"], "readOnly": True}},
        tmp_volume(),
    ]
    # SIGTERM starts the worker's own drain (worker/src/drain.rs): not ready,
    # deregistered, in-flight streams finish within --drain-timeout, then
    # exit. The grace period covers that, the 3 s the registration gets to
    # revoke its lease, and a margin; a preStop delay would only postpone it.
    grace = w["drainTimeoutS"] + 3 + 10
    spec = pod_spec([c], volumes, grace)
    out = [
        deployment(name, v, "worker", w["replicas"], spec, labels),
        pdb(name, v, "worker", labels, max_unavailable=1),
    ]
    out.append(keda_scaled_object(v, w, name, labels) if v["autoscaling"]["engine"] == "keda" else hpa(v, w, name, labels))
    return out


def hpa(v, w, name, labels):
    a = w["autoscale"]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta(name, v, "worker", labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": a["min"],
            "maxReplicas": a["max"],
            # Per-pod series through the Prometheus adapter (its rules:
            # the tokenmesh-prometheus-adapter ConfigMap).
            "metrics": [
                pods_metric("llm_queue_depth", str(a["queueDepth"])),
                pods_metric("llm_kv_cache_usage_ratio", f"{int(a['kvUsage'] * 1000)}m"),
            ],
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
        },
    }


def keda_scaled_object(v, w, name, labels):
    """A KEDA ScaledObject for one worker Deployment: a Prometheus trigger on
    the version's waiting requests (the worker's llm_queue_depth, summed over
    its pods and priorities; job="worker" is the worker ServiceMonitor's
    jobLabel), one replica per `queueDepth` of them (AverageValue)."""
    a, k = w["autoscale"], v["autoscaling"]
    query = f'sum(llm_queue_depth{{job="worker",namespace="{v["namespace"]}",version="{w["version"]}"}})'
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta(name, v, "worker", labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": a["min"],
            "maxReplicaCount": a["max"],
            "pollingInterval": k["pollingIntervalS"],
            "cooldownPeriod": k["cooldownPeriodS"],
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}},
                },
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": k["prometheusUrl"],
                        "query": query,
                        # KEDA's trigger metadata are strings.
                        "threshold": str(a["queueDepth"]),
                    },
                }
            ],
        },
    }


def pods_metric(name, average):
    return {
        "type": "Pods",
        "pods": {"metric": {"name": name}, "target": {"type": "AverageValue", "averageValue": average}},
    }


def worker_metrics_service(v):
    return service("tokenmesh-worker", v, "worker", {"metrics": PORTS["worker"]["metrics"]}, headless=True)


# --- network policies -------------------------------------------------------


def from_pods(component):
    return {"podSelector": {"matchLabels": selector(component)}}


def from_monitoring(v):
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": v["monitoringNamespace"]}}}


def netpol(name, v, component, rules):
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(name, v, component),
        "spec": {
            "podSelector": {"matchLabels": selector(component)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": f, "ports": [{"port": port} for port in ports]} for f, ports in rules],
        },
    }


def network_policies(v):
    mon = [from_monitoring(v)]
    # Operators: pods labelled tokenmesh.io/operator=true, in any namespace.
    operators = [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"tokenmesh.io/operator": "true"}}}]
    out = [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta("tokenmesh-default-deny", v, "policy"),
            "spec": {"podSelector": {"matchLabels": dict(PART_OF)}, "policyTypes": ["Ingress"]},
        },
        netpol("tokenmesh-worker", v, "worker", [([from_pods("router")], ["grpc"]), (mon, ["metrics"])]),
        netpol("tokenmesh-control", v, "control", [(operators, ["grpc"]), (mon, ["metrics"])]),
        # Clients come from anywhere the Service is reachable from.
        {
            **netpol("tokenmesh-router", v, "router", [(mon, ["metrics"])]),
        },
    ]
    out[-1]["spec"]["ingress"].insert(0, {"ports": [{"port": "grpc"}, {"port": "http"}]})
    if not v["etcd"]["external"]:
        clients = [from_pods(c) for c in ("router", "worker", "control", "bootstrap")]
        out.append(
            netpol("tokenmesh-etcd", v, "etcd", [(clients, ["client"]), ([from_pods("etcd")], ["peer"]), (mon, ["metrics"])])
        )
    return out


# --- certificates -----------------------------------------------------------


def leaves(v):
    """The Secrets of fixed identities: (secret, role, name, DNS names)."""
    ns = v["namespace"]
    svc = lambda s: [s, f"{s}.{ns}", f"{s}.{ns}.svc", f"{s}.{ns}.svc.cluster.local"]
    out = [
        ("tokenmesh-router-tls", "router", "tokenmesh-router", svc("tokenmesh-router")),
        ("tokenmesh-control-tls", "control", "tokenmesh-control", svc("tokenmesh-control")),
        ("tokenmesh-operator-tls", "operator", "operator", []),
    ]
    if not v["etcd"]["external"]:
        # The mesh has no etcd role: etcd members get `auditor`, the role with
        # the least rights, as in the compose file.
        dns = [f"*.tokenmesh-etcd.{ns}.svc", f"*.tokenmesh-etcd.{ns}.svc.cluster.local"]
        out.append(("tokenmesh-etcd-tls", "auditor", "tokenmesh-etcd", dns))
    return out


def issuer(v):
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Issuer",
        "metadata": meta("tokenmesh-ca", v, "certificates"),
        "spec": {"ca": {"secretName": "tokenmesh-ca"}},
    }


def cert_manager(v):
    """CA bootstrapped by cert-manager, and one Certificate per leaf Secret."""
    selfsigned = {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Issuer",
        "metadata": meta("tokenmesh-selfsigned", v, "certificates"),
        "spec": {"selfSigned": {}},
    }
    ca = {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": meta("tokenmesh-ca", v, "certificates"),
        "spec": {
            "isCA": True,
            "commonName": "tokenmesh CA",
            "secretName": "tokenmesh-ca",
            "duration": "87600h",
            "privateKey": {"algorithm": "ECDSA", "size": 256},
            "issuerRef": {"name": "tokenmesh-selfsigned", "kind": "Issuer"},
        },
    }
    out = [selfsigned, ca, issuer(v)]
    for secret, role, name, dns in leaves(v):
        spec = {
            "secretName": secret,
            "commonName": name,
            "uris": [f"spiffe://tokenmesh/{role}/{name}"],
            "duration": v["tls"]["leafDuration"],
            "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
            "usages": ["server auth", "client auth", "digital signature", "key encipherment"],
            "issuerRef": {"name": "tokenmesh-ca", "kind": "Issuer"},
        }
        if dns:
            spec["dnsNames"] = dns
        out.append(
            {"apiVersion": "cert-manager.io/v1", "kind": "Certificate", "metadata": meta(secret, v, "certificates"), "spec": spec}
        )
    return out


def cert_job(v):
    """Issues the CA and leaves with tokenmesh-certs (the CA is reused when
    its Secret exists, so a rerun renews the leaves) and applies them as
    kubernetes.io/tls Secrets with kubectl."""
    ns, sa = v["namespace"], "tokenmesh-certs"
    secrets = ["tokenmesh-ca"] + [s for s, *_ in leaves(v)]
    fetch = (
        "set -eu; cd /work\n"
        # Only NotFound counts as absent: any other error stops the Job rather
        # than replacing the CA every certificate chains to.
        "found=$(kubectl get secret tokenmesh-ca --ignore-not-found -o name)\n"
        "if [ -n \"$found\" ]; then\n"
        "  mkdir -p ca\n"
        "  kubectl get secret tokenmesh-ca -o jsonpath='{.data.tls\\.crt}' | base64 -d > ca/ca.pem\n"
        "  kubectl get secret tokenmesh-ca -o jsonpath='{.data.tls\\.key}' | base64 -d > ca/ca.key\n"
        "fi\n"
    )
    issue = ["set -eu; cd /work"]
    for secret, role, name, dns in leaves(v):
        flags = " ".join(f"--dns '{d}'" for d in dns)
        issue.append(
            f"tokenmesh-certs issue --ca-dir ca --dir {secret} --role {role} --name {name} "
            f"--days {int(v['tls']['leafDuration'].rstrip('h')) // 24} {flags} >/dev/null"
        )
    apply = ["set -eu; cd /work"]
    tls = lambda s, cert, key: (
        f"kubectl create secret generic {s} --type kubernetes.io/tls --from-file=tls.crt={cert} "
        f"--from-file=tls.key={key} --from-file=ca.crt=ca/ca.pem --dry-run=client -o yaml | kubectl apply -f -"
    )
    apply.append(tls("tokenmesh-ca", "ca/ca.pem", "ca/ca.key"))
    for secret, role, *_ in leaves(v):
        apply.append(tls(secret, f"{secret}/{role}.pem", f"{secret}/{role}.key"))
    work = [{"name": "work", "mountPath": "/work"}, tmp_mount()]
    res = resources("100m", 128)

    def step(name, image, script):
        return {
            "name": name,
            "image": image,
            "imagePullPolicy": v["imagePullPolicy"],
            "command": ["/bin/bash", "-c", script],
            # kubectl keeps a cache under $HOME; the root filesystem is read-only.
            "env": [{"name": "HOME", "value": "/tmp"}],
            "resources": res,
            "securityContext": security(),
            "volumeMounts": work,
        }

    kubectl = v["tls"]["kubectlImage"]
    spec = pod_spec(
        [step("apply", kubectl, "\n".join(apply))],
        [{"name": "work", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}}, tmp_volume()],
        30,
        init=[step("fetch-ca", kubectl, fetch), step("issue", v["image"], "\n".join(issue))],
        sa=sa,
        restart="OnFailure",
    )
    rules = [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": secrets, "verbs": ["get", "patch", "update"]},
        # `create` cannot be limited by name in RBAC.
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    ]
    m = lambda kind_name: meta(kind_name, v, "certificates")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": m(sa), "automountServiceAccountToken": False},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": m(sa), "rules": rules},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": m(sa),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": m("tokenmesh-certs"),
            "spec": {"backoffLimit": 3, "template": {"metadata": {"labels": m("tokenmesh-certs")["labels"]}, "spec": spec}},
        },
        issuer(v),
    ]


# --- bootstrap of the traffic policy ----------------------------------------


def policy_job(v):
    """Writes models/{model}/policy once (an operator's later change survives
    a re-apply), as the compose file's policy-init does."""
    model = v["model"]
    policy = {"stable": model["stable"]}
    if model["canary"]["version"]:
        policy["canary"] = {"version": model["canary"]["version"], "weight": model["canary"]["weight"]}
    env = pod_env() + [
        {"name": "TOKENMESH_MODEL_NAME", "value": model["name"]},
        {"name": "TOKENMESH_POLICY", "value": json.dumps(policy, separators=(",", ":"))},
        {"name": "ETCDCTL_API", "value": "3"},
        {"name": "ETCDCTL_ENDPOINTS", "value": etcd_urls(v)},
        {"name": "ETCDCTL_CACERT", "value": f"{CERTS}/ca.crt"},
        {"name": "ETCDCTL_CERT", "value": f"{CERTS}/tls.crt"},
        {"name": "ETCDCTL_KEY", "value": f"{CERTS}/tls.key"},
    ]
    c = {
        "name": "policy-init",
        "image": v["image"],
        "imagePullPolicy": v["imagePullPolicy"],
        "args": ["policy-init"],
        "env": env,
        "resources": resources("100m", 64),
        "securityContext": security(),
        "volumeMounts": [certs_mount(), tmp_mount()],
    }
    spec = pod_spec([c], [secret_volume("tokenmesh-operator-tls"), tmp_volume()], 10, restart="OnFailure")
    m = meta("tokenmesh-policy-init", v, "bootstrap")
    return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": m, "spec": {"backoffLimit": 10, "template": {"metadata": {"labels": m["labels"]}, "spec": spec}}}]


# --- monitoring -------------------------------------------------------------


def monitoring(v):
    out = []
    for component in ("router", "worker", "control"):
        out.append(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "ServiceMonitor",
                "metadata": meta(f"tokenmesh-{component}", v, component),
                "spec": {
                    # job="router" / "worker" / "control", what the rules and
                    # the dashboard select on.
                    "jobLabel": "tokenmesh.io/job",
                    "selector": {"matchLabels": {**selector(component), "tokenmesh.io/job": component}},
                    "endpoints": [{"port": "metrics", "interval": "15s", "path": "/metrics"}],
                },
            }
        )
    groups = []
    for f in ("alerts.yml", "recording.yml"):
        groups += yaml.safe_load((DEPLOY / "prometheus" / f).read_text())["groups"]
    out.append(
        {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            "metadata": meta("tokenmesh", v, "monitoring"),
            "spec": {"groups": groups},
        }
    )
    dash = meta("tokenmesh-dashboard", v, "monitoring")
    dash["labels"]["grafana_dashboard"] = "1"
    out.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": dash,
            "data": {"tokenmesh-dashboard.json": (DEPLOY / "grafana" / "tokenmesh-dashboard.json").read_text()},
        }
    )
    rules = {
        "rules": [
            {
                "seriesQuery": f'{name}{{job="worker",namespace!="",pod!=""}}',
                "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
                "name": {"matches": f"^{name}$", "as": name},
                "metricsQuery": "max(<<.Series>>{<<.LabelMatchers>>}) by (<<.GroupBy>>)",
            }
            for name in ("llm_queue_depth", "llm_kv_cache_usage_ratio", "llm_active_streams")
        ]
    }
    if v["autoscaling"]["engine"] == "hpa":
        # KEDA asks Prometheus itself; only the HPAs need the adapter.
        out.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": meta("tokenmesh-prometheus-adapter", v, "monitoring"),
                "data": {"config.yaml": yaml.safe_dump(rules, sort_keys=False)},
            }
        )
    return out


def render(v):
    ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": v["namespace"], "labels": dict(PART_OF)}}
    objs = [ns]
    objs += cert_job(v) if v["tls"]["issuer"] == "job" else cert_manager(v)
    objs += etcd(v) + policy_job(v) + router(v) + control(v) + [worker_metrics_service(v)]
    for w in v["workers"]:
        objs += worker(v, w)
    objs += network_policies(v) + monitoring(v)
    return objs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--values", default=str(HERE / "values.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one value (dotted key)")
    ap.add_argument("--format", choices=["yaml", "json"], default="yaml")
    a = ap.parse_args()
    try:
        objs = render(load_values(a.values, a.set))
    except (ValuesError, OSError, yaml.YAMLError) as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    if a.format == "json":
        json.dump(objs, sys.stdout, indent=1)
        print()
    else:
        print(yaml.safe_dump_all(copy.deepcopy(objs), sort_keys=False, width=120), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
