"""``embtables serve ARTIFACT --port P``: a model artifact as an HTTP JSON service, kept fresh while training runs.

    POST /predict   {"rows": {"column": [v1, v2, ...], ...}}  or  {"instances": [{"column": v, ...}, ...]}
                    -> {"predictions": [p1, p2, ...], "step": S}
    GET  /health    -> {"status": "ok", "step": S, "age_s": seconds since step S was exported, "requests": ...,
                        "errors": ..., "updates": ..., "latency_ms": {"p50": ..., "p99": ...}}

The HTTP stack is the standard library's ``ThreadingHTTPServer``: a thread per connection, no dependency to
install or keep, and the work of a request is torch's (which releases the interpreter lock while it computes);
what a web framework would add (routing, validation) is two endpoints here. A background thread polls the
artifact every ``--poll`` seconds (``ScoringModel.update``): new serving deltas and the dense weights of their
step, or a whole new export, are taken in under load with no restart, and a response sees one step, never a
mix. A bad request is a 400 with the one-line reason; the service keeps serving what it served when an update
fails (logged, retried at the next poll).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embtables.estimator.model_artifact import WEIGHTS
from embtables.estimator.scoring_model import ScoringModel, load_model

logger = logging.getLogger("embtables.serve")
MAX_BODY = 64 << 20  # bytes of one request
LATENCIES = 4096  # the latest requests' latencies kept for the percentiles
REPEAT_LOG_S = 60.0  # the same update failure is logged again at most this often


class Service:
    """The served model, its update thread and its counters."""

    def __init__(self, model: ScoringModel, poll: float) -> None:
        self.model, self.poll = model, poll
        self.started = time.time()
        self.requests = self.errors = self.updates = self.update_errors = 0
        self.last_update_error: str | None = None  # the reason of the failing updates, None once one works
        self._failing, self._logged = 0, 0.0
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCIES)
        self._count = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="embtables-serve-update", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        while not self._stop.wait(self.poll):
            before = self.model.step
            try:
                step = self.model.update()
            except Exception as exc:  # keep serving what is served; retried at the next poll
                self.update_errors += 1
                self._failed(before, str(exc))
                continue
            if self.last_update_error is not None:
                logger.info("embtables serve: updates work again after %d failed polls", self._failing)
                self.last_update_error, self._failing = None, 0
            if step != before:
                self.updates += 1
                logger.info("embtables serve: now serving step %d", step)

    def _failed(self, step: int, message: str) -> None:
        """Log a failed update: a new reason at once, the same one again at most every ``REPEAT_LOG_S`` seconds
        (a poll a second would otherwise log a line a second while, say, a training job rewrites the artifact)."""
        self._failing += 1
        now = time.monotonic()
        if message != self.last_update_error or now - self._logged >= REPEAT_LOG_S:
            again = f" ({self._failing} failed polls in a row)" if message == self.last_update_error else ""
            logger.warning("embtables serve: update failed (still serving step %d)%s: %s", step, again, message)
            self._logged = now
        self.last_update_error = message

    def age(self) -> float | None:
        """Seconds since the served step's weights were written (its export)."""
        path = Path(self.model.root) / WEIGHTS / f"step-{self.model.step:010d}.pt"
        try:
            return max(0.0, time.time() - path.stat().st_mtime)
        except OSError:
            return None

    def record(self, seconds: float, ok: bool) -> None:
        with self._count:
            self.requests += 1
            self.errors += 0 if ok else 1
            self._latencies.append(seconds)

    def health(self) -> dict[str, Any]:
        with self._count:
            lat = np.array(self._latencies) * 1e3
            counts = {"requests": self.requests, "errors": self.errors}
        latency = {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))} if lat.size else {}
        return {
            "status": "ok", "step": self.model.step, "age_s": self.age(), **counts, "updates": self.updates,
            "update_errors": self.update_errors, "last_update_error": self.last_update_error,
            "uptime_s": time.time() - self.started, "latency_ms": latency,
            "task": self.model.task,
        }  # fmt: skip

    def predict(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ValueError('the body must be a JSON object {"rows": {column: [values]}} or {"instances": [...]}')
        if "rows" in body:
            rows = body["rows"]
            if not isinstance(rows, dict) or not all(isinstance(v, list) for v in rows.values()):
                raise ValueError('"rows" must be an object {column: [one value per row]}')
        elif "instances" in body:
            instances = body["instances"]
            if not isinstance(instances, list) or not all(isinstance(r, dict) for r in instances):
                raise ValueError('"instances" must be a list of objects {column: value}')
            keys = sorted({k for r in instances for k in r})
            rows = {k: [r.get(k) for r in instances] for k in keys}
        else:
            raise ValueError('the body needs "rows" or "instances"')
        predictions, step = self.model.score(rows)  # one batch, one step
        return {"predictions": predictions.float().reshape(-1).tolist(), "step": step}


def _handler(service: Service) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client's requests reuse one connection
        # A response leaves in one write (headers and body buffered, flushed once per request) with Nagle's
        # algorithm off: written apart, the body would wait for the client's delayed ACK of the headers (40 ms).
        wbufsize = 1 << 16
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

        def _send(self, code: int, doc: dict[str, Any], close: bool = False) -> None:
            """The JSON response; ``close``: the request's body was not read (a refusal before it), so the
            connection ends here instead of reading that body as the next request."""
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if code == 405:
                self.send_header("Allow", "GET, POST")
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _not_allowed(self) -> None:
            self._send(405, {"error": f"method {self.command} is not served: GET /health, POST /predict"}, close=True)

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

        def do_GET(self) -> None:
            if self.path.split("?")[0] in ("/health", "/"):
                self._send(200, service.health())
            else:
                self._send(404, {"error": f"no such endpoint {self.path!r}: GET /health, POST /predict"})

        def do_POST(self) -> None:
            start = time.perf_counter()
            if self.path.split("?")[0] != "/predict":
                self._send(404, {"error": f"no such endpoint {self.path!r}: POST /predict"}, close=True)
                return
            ok, close = False, True  # until the body is read: a refusal before it ends the connection
            try:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    code, doc = 411, {"error": "a chunked body is not read: send it with a Content-Length"}
                elif not 0 < (length := int(self.headers.get("Content-Length") or 0)) <= MAX_BODY:
                    code = 413 if length > MAX_BODY else 400
                    doc = {"error": f"a body of 1 to {MAX_BODY} bytes (Content-Length {length})"}
                else:
                    raw = self.rfile.read(length)
                    close = len(raw) < length  # the client closed its side early
                    body = json.loads(raw)
                    code, doc, ok = 200, service.predict(body), True
            except (ValueError, TypeError, KeyError) as exc:
                code, doc = 400, {"error": " ".join(str(exc).split())}
            except Exception as exc:  # a fault of the service: said, and the service goes on
                logger.exception("embtables serve: a request failed")
                code, doc = 500, {"error": f"{type(exc).__name__}: {exc}"}
            self._send(code, doc, close)
            service.record(time.perf_counter() - start, ok)

    return Handler


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("artifact", help="a model artifact (embtables export MODEL_DIR OUT --model)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8500, help="the port (default 8500; 0: any free port)")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between checks for a newer step (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per request (default 1)")


def run(args: argparse.Namespace) -> int:
    if not args.poll > 0:
        raise ValueError(f"--poll must be > 0 seconds, got {args.poll}")
    if args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    service = Service(load_model(args.artifact), args.poll)
    server = ThreadingHTTPServer((args.host, args.port), _handler(service))
    server.daemon_threads = True
    host, port = str(server.server_address[0]), int(server.server_address[1])
    print(f"embtables serve: {args.artifact} (step {service.model.step}) on http://{host}:{port} "
          "(POST /predict, GET /health)", flush=True)  # fmt: skip
    stopping = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        if not stopping.is_set():
            stopping.set()
            threading.Thread(target=server.shutdown, daemon=True).start()

    previous = signal.signal(signal.SIGTERM, stop)
    service.start()
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        service.stop()
        server.server_close()
    print(f"embtables serve: stopped after {service.requests} requests", file=sys.stderr)
    return 0


__all__ = ["Service", "add_arguments", "run"]
