"""Object writes of a `berth run`, counted on the wire: the recovery issue's "writes per 1,000 tokens".

``berth run`` (the CLI, in a child process, default settings: checkpoints every 16 tokens, the
default model) runs a job of ``--requests`` requests of ``--tokens`` generated tokens each
(``ignore_eos``, greedy) with its job files and checkpoints on S3: moto's server in a child process,
reached through a counting proxy in this process that forwards every HTTP request unchanged and
counts them by method (PUT, POST, GET, HEAD, DELETE) and the bytes of their bodies. What the proxy
counts is what an S3 bill counts: a PUT (or POST, a multipart upload's start and end) is a write.

    python benchmarks/checkpoint_writes.py                      # 48 x 160, the issue's case
    python benchmarks/checkpoint_writes.py --requests 8 --tokens 64

It prints the counts, the writes per 1,000 generated tokens, and writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from benchmarks.checkpoint_bench import S3_ENV, moto_server

ROOT = Path(__file__).resolve().parents[1]


class CountingProxy:
    """An HTTP proxy to ``upstream`` (host, port) counting requests by method, and bytes sent by
    method, per key kind (``checkpoints/...`` or other)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                kind = "checkpoints" if "/checkpoints/" in self.path else "other"
                with proxy.lock:
                    proxy.requests[f"{self.command} {kind}"] += 1
                    proxy.bytes[f"{self.command} {kind}"] += length
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def write_input(path: Path, requests: int, tokens: int) -> None:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "SmolLM2-135M-Instruct",
                       "prompt": f"Story {i}: once upon a time, in a town by the sea,",
                       "max_tokens": tokens, "temperature": 0, "ignore_eos": True}} for i in range(requests)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/checkpoint-writes.json")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for berth run (repeatable)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, moto_server() as (bucket_url, _pid):
        tmp = Path(tmp)
        write_input(tmp / "in.jsonl", args.requests, args.tokens)
        moto_port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
        with CountingProxy(("127.0.0.1", moto_port)) as proxy:
            env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
                   "BERTH_DATABASE_URL": f"sqlite:///{tmp / 'berth.db'}",
                   "BERTH_STORAGE_URL": f"{bucket_url}/run-{uuid.uuid4().hex[:8]}",
                   "PYTHONPATH": str(ROOT)}
            env.update(dict(e.split("=", 1) for e in args.env))
            t0 = time.perf_counter()
            command = [sys.executable, "-m", "jobs.cli", "run", str(tmp / "in.jsonl"), "-o", str(tmp / "out.jsonl"),
                       "--quiet"]
            proc = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, check=False)
            seconds = time.perf_counter() - t0
            if proc.returncode:
                sys.exit(f"berth run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            out = [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]
            tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in out)
            counts, sizes = dict(proxy.requests), dict(proxy.bytes)
    writes = sum(n for k, n in counts.items() if k.split()[0] in ("PUT", "POST"))
    checkpoint_writes = sum(n for k, n in counts.items() if k in ("PUT checkpoints", "POST checkpoints"))
    written = sum(n for k, n in sizes.items() if k.split()[0] in ("PUT", "POST"))
    report = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "requests": args.requests,
              "tokens_each": args.tokens, "generated_tokens": tokens, "seconds": round(seconds, 1),
              "env": args.env, "http_requests": counts, "bytes_sent": sizes, "writes": writes,
              "checkpoint_writes": checkpoint_writes, "bytes_written": written,
              "writes_per_1000_tokens": round(1000 * writes / tokens, 2),
              "checkpoint_writes_per_1000_tokens": round(1000 * checkpoint_writes / tokens, 2)}
    print(f"berth run: {args.requests} requests x {args.tokens} tokens = {tokens} generated tokens in {seconds:.1f} s")
    print(f"S3 requests: {json.dumps(counts, sort_keys=True)}")
    print(f"writes (PUT + POST): {writes} ({checkpoint_writes} of checkpoints), {written / 1e6:.1f} MB; "
          f"{report['writes_per_1000_tokens']} writes per 1,000 tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
