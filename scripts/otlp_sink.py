#!/usr/bin/env python3
"""A minimal OTLP/gRPC trace sink for benchmarks: accepts every
TraceService/Export call, counts the calls and bytes, and answers with an empty
ExportTraceServiceResponse (which is zero bytes on the wire). It decodes
nothing, so its own cost stays small; it stands in for a collector that is up.

Usage: python scripts/otlp_sink.py PORT   (needs grpcio; prints totals on SIGTERM)
"""

import signal
import sys
import threading
from concurrent import futures

import grpc

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


class Sink(grpc.GenericRpcHandler):
    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0
        self.bytes = 0

    def service(self, details):
        if details.method != EXPORT:
            return None

        def export(request, _context):
            with self.lock:
                self.calls += 1
                self.bytes += len(request)
            return b""

        # No (de)serializers: the request arrives as bytes, the reply is bytes.
        return grpc.unary_unary_rpc_method_handler(export)


def main():
    port = int(sys.argv[1])
    sink = Sink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    server.add_generic_rpc_handlers((sink,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"otlp sink on 127.0.0.1:{port}", flush=True)
    done.wait()
    server.stop(0)
    print(f"export calls {sink.calls}, bytes {sink.bytes}", flush=True)


if __name__ == "__main__":
    main()
