"""A minimal OTLP/HTTP trace receiver for bench/feature_costs.sh: answers every
POST (`/v1/traces`) 200 with an empty ExportTraceServiceResponse and counts
the exports, their bytes and the spans in them. Prints `listening PORT`, and
on SIGTERM one JSON line of the counts.

    python3 bench/otlp_receiver.py
"""
import http.server
import json
import signal
import sys
import threading

counts = {"exports": 0, "bytes": 0, "spans": 0}
lock = threading.Lock()


def varint(buf, i):
    value = shift = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def fields(buf):
    """(field number, bytes) of each length-delimited field of a message."""
    i = 0
    while i < len(buf):
        key, i = varint(buf, i)
        wire = key & 7
        if wire == 0:
            _, i = varint(buf, i)
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        elif wire == 2:
            n, i = varint(buf, i)
            yield key >> 3, buf[i:i + n]
            i += n
        else:
            raise ValueError(f"wire type {wire}")


def span_count(body):
    # ExportTraceServiceRequest.resource_spans(1).scope_spans(2).spans(2)
    return sum(1 for f, rs in fields(body) if f == 1
               for g, ss in fields(rs) if g == 2
               for h, _ in fields(ss) if h == 2)


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        with lock:
            counts["exports"] += 1
            counts["bytes"] += len(body)
            counts["spans"] += span_count(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_):
        pass


server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)


def done(*_):
    with lock:
        print(json.dumps(counts), flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, done)
print(f"listening {server.server_address[1]}", flush=True)
server.serve_forever()
