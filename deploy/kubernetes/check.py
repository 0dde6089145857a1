#!/usr/bin/env python3
"""Validates rendered manifests offline.

    python3 deploy/kubernetes/render.py | python3 deploy/kubernetes/check.py [-k 1.31.0] [-]

Core kinds are checked, strictly (an unknown field is an error), against the
Kubernetes OpenAPI schemas that `kubernetes-validate` (PyPI) ships. Its
schemas hold no custom resources, so ServiceMonitor, PrometheusRule,
cert-manager's Issuer and Certificate and KEDA's ScaledObject are checked
against the structural
schemas below: written here from those projects' documented fields, covering
what render.py emits, with unknown fields refused. They are not the upstream
CRDs' own schemas. Prints one line per object; exits 1 on any error.
"""
import argparse
import sys

import jsonschema
import kubernetes_validate
import yaml

S = {"type": "string", "minLength": 1}
META = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": S, "namespace": S, "labels": {"type": "object", "additionalProperties": {"type": "string"}}},
    "additionalProperties": False,
}


def obj(props, required=(), extra=False):
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": extra}


def crd(spec):
    return obj({"apiVersion": S, "kind": S, "metadata": META, "spec": spec}, ["apiVersion", "kind", "metadata", "spec"])


LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
RULE = obj(
    {
        "alert": S,
        "record": S,
        "expr": S,
        "for": {"type": "string", "pattern": "^[0-9]+[smhdwy]$"},
        "labels": LABELS,
        "annotations": LABELS,
    },
    ["expr"],
)
RULE["oneOf"] = [{"required": ["alert"]}, {"required": ["record"]}]
ISSUER_REF = obj({"name": S, "kind": {"enum": ["Issuer", "ClusterIssuer"]}, "group": S}, ["name"])
USAGES = {"enum": ["server auth", "client auth", "digital signature", "key encipherment"]}

SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): crd(
        obj(
            {
                "jobLabel": S,
                "selector": obj({"matchLabels": LABELS}, ["matchLabels"]),
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": obj(
                        {"port": S, "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"}, "path": S}, ["port"]
                    ),
                },
            },
            ["selector", "endpoints"],
        )
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): crd(
        obj(
            {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": obj(
                        {
                            "name": S,
                            "interval": {"type": "string", "pattern": "^[0-9]+[smh]$"},
                            "rules": {"type": "array", "minItems": 1, "items": RULE},
                        },
                        ["name", "rules"],
                    ),
                }
            },
            ["groups"],
        )
    ),
    ("keda.sh/v1alpha1", "ScaledObject"): crd(
        obj(
            {
                "scaleTargetRef": obj(
                    {"apiVersion": S, "kind": {"enum": ["Deployment", "StatefulSet"]}, "name": S}, ["name"]
                ),
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": obj(
                    {
                        "horizontalPodAutoscalerConfig": obj(
                            # The HPA's own behavior field, as autoscaling/v2 has it.
                            {"behavior": {"type": "object"}, "name": S}
                        )
                    }
                ),
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": obj(
                        {
                            "type": {"const": "prometheus"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "metadata": obj(
                                {
                                    "serverAddress": {"type": "string", "pattern": "^https?://"},
                                    "query": S,
                                    "threshold": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$"},
                                    "activationThreshold": {"type": "string"},
                                },
                                ["serverAddress", "query", "threshold"],
                            ),
                        },
                        ["type", "metadata"],
                    ),
                },
            },
            ["scaleTargetRef", "triggers"],
        )
    ),
    ("cert-manager.io/v1", "Issuer"): crd(
        {
            "type": "object",
            "properties": {"ca": obj({"secretName": S}, ["secretName"]), "selfSigned": obj({})},
            "additionalProperties": False,
            "minProperties": 1,
            "maxProperties": 1,
        }
    ),
    ("cert-manager.io/v1", "Certificate"): crd(
        obj(
            {
                "secretName": S,
                "commonName": S,
                "isCA": {"type": "boolean"},
                "duration": {"type": "string", "pattern": "^[0-9]+h$"},
                "uris": {"type": "array", "items": {"type": "string", "pattern": "^spiffe://tokenmesh/[a-z]+/.+"}},
                "dnsNames": {"type": "array", "items": S},
                "usages": {"type": "array", "items": USAGES},
                "privateKey": obj(
                    {
                        "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                        "size": {"type": "integer"},
                        "rotationPolicy": {"enum": ["Never", "Always"]},
                    }
                ),
                "issuerRef": ISSUER_REF,
            },
            ["secretName", "issuerRef"],
        )
    ),
}


def check(doc, version):
    """None if `doc` is valid, else why not."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in SCHEMAS:
        try:
            jsonschema.validate(doc, SCHEMAS[key])
        except jsonschema.ValidationError as e:
            return f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        return None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{'/'.join(map(str, e.path))}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        return f"no schema for {key}: {e}"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-k", "--kubernetes-version", default="1.31.0")
    ap.add_argument("files", nargs="*", default=["-"])
    a = ap.parse_args()
    bad = 0
    for f in a.files:
        text = sys.stdin.read() if f == "-" else open(f).read()
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            err = check(doc, a.kubernetes_version)
            how = "custom schema" if (doc.get("apiVersion"), doc.get("kind")) in SCHEMAS else f"kubernetes {a.kubernetes_version}"
            if err:
                bad += 1
                print(f"INVALID {name} ({how}): {err}")
            else:
                print(f"valid {name} ({how})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
