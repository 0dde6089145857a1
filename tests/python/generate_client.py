#!/usr/bin/env python3
"""Streams one Generate from a tokenmesh router with grpcio.

Stubs are generated from proto/ at run time with grpc_tools, as any Python
user of the mesh would. Prints one JSON line: the text, the finish reason,
usage, the serving worker and whether seq numbers were 0, 1, 2, ... .
"""
import argparse
import importlib
import json
import sys
import tempfile

import grpc
from grpc_tools import protoc


def load_stubs(proto_dir: str, out_dir: str):
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        "tokenmesh/v1/tokenmesh.proto",
    ])
    if rc != 0:
        sys.exit(f"protoc failed with {rc}")
    sys.path.insert(0, out_dir)
    pb = importlib.import_module("tokenmesh.v1.tokenmesh_pb2")
    rpc = importlib.import_module("tokenmesh.v1.tokenmesh_pb2_grpc")
    return pb, rpc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True, help="router host:port")
    ap.add_argument("--proto-dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--question", default="What is the capital of France?")
    ap.add_argument("--cacert", help="CA certificate (PEM): mutual TLS instead of plaintext")
    ap.add_argument("--cert", help="client certificate (PEM), with --cacert")
    ap.add_argument("--key", help="client private key (PEM), with --cacert")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as gen:
        pb, rpc = load_stubs(args.proto_dir, gen)
        req = pb.GenerateRequest(
            model=args.model,
            messages=[
                pb.ChatMessage(role="system", content="You are a helpful assistant."),
                pb.ChatMessage(role="user", content=args.question),
            ],
            max_tokens=48,
            temperature=0.0,
        )
        if args.cacert:
            def read(path):
                with open(path, "rb") as f:
                    return f.read()
            creds = grpc.ssl_channel_credentials(
                root_certificates=read(args.cacert),
                private_key=read(args.key),
                certificate_chain=read(args.cert),
            )
            channel = grpc.secure_channel(args.target, creds)
        else:
            channel = grpc.insecure_channel(args.target)
        with channel:
            stub = rpc.InferenceStub(channel)
            text, seqs, finished, worker = [], [], None, None
            for msg in stub.Generate(req, timeout=120):
                seqs.append(msg.seq)
                kind = msg.WhichOneof("event")
                if kind == "accepted":
                    worker = msg.accepted.worker_id
                elif kind == "delta":
                    text.append(msg.delta.text)
                elif kind == "finished":
                    finished = msg.finished
        print(json.dumps({
            "text": "".join(text),
            "finish_reason": pb.FinishReason.Name(finished.finish_reason) if finished else None,
            "prompt_tokens": finished.usage.prompt_tokens if finished else None,
            "completion_tokens": finished.usage.completion_tokens if finished else None,
            "worker": worker,
            "seq_ok": seqs == list(range(len(seqs))),
        }))


if __name__ == "__main__":
    main()
