#!/usr/bin/env python3
"""Prints a worker's Worker.Status as JSON, with grpcio alone (no generated
stubs, no grpcurl): the request is empty and the reply's fields are decoded
from the wire format by number. Used by scripts/gpu-check.sh.

Usage: worker_status.py HOST:PORT
"""
import json
import sys

import grpc

# StatusResponse (proto/tokenmesh/v1/tokenmesh.proto): field number -> name.
FIELDS = {
    1: "worker_id", 2: "model", 3: "version", 4: "active_sequences",
    5: "queue_depth", 6: "kv_blocks_used", 7: "kv_blocks_total",
    8: "accelerator", 9: "device", 10: "draining", 11: "max_context",
    12: "capacity", 13: "queue_depth_high", 14: "queue_depth_normal",
    15: "queue_depth_low", 16: "tokens_generated", 17: "preemptions",
}


def varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def decode(buf):
    out, i = {}, 0
    while i < len(buf):
        key, i = varint(buf, i)
        number, wire = key >> 3, key & 7
        name = FIELDS.get(number, f"field_{number}")
        if wire == 0:
            out[name], i = varint(buf, i)
        elif wire == 2:
            n, i = varint(buf, i)
            out[name] = buf[i:i + n].decode("utf-8", "replace")
            i += n
        else:
            raise ValueError(f"unexpected wire type {wire} for field {number}")
    return out


def main():
    target = sys.argv[1]
    with grpc.insecure_channel(target) as channel:
        status = channel.unary_unary("/tokenmesh.v1.Worker/Status")
        reply = status(b"", timeout=10)
    print(json.dumps(decode(reply), sort_keys=True))


if __name__ == "__main__":
    main()
