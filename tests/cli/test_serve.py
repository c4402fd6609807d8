"""``embtables serve`` (issue 60, items 3-4): a real server process on loopback, a real HTTP client; predictions
equal ``load_model``'s bit for bit; the online loop: a training job exporting into the served artifact
(``--save-every --incremental --export-to``) while 4 clients send requests, every response computed at one step
(responses of the same step agree exactly), the service reaching the last step with no restart; health counts,
and bad requests answered 400 with the reason."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

import embtables as et
from embtables.__main__ import main as cli
from embtables.data import sample_path

ROOT = Path(__file__).resolve().parents[2]


def _request(url: str, body: Any = None, timeout: float = 30) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _train(model_dir: Path, artifact: Path, epochs: int) -> int:
    argv = ["--data", sample_path("clicks.csv"), "--schema", sample_path("clicks.schema.json"), "--batch-size", "64"]
    argv += ["--model-dir", str(model_dir), "--save-every", "10", "--incremental", "--export-to", str(artifact)]
    return cli(["train", *argv, "--epochs", str(epochs), "--no-progress", "--threads", "1"])


class _Server:
    def __init__(self, artifact: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "embtables", "serve", str(artifact), "--port", "0", "--poll", "0.2"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "embtables serve: ... on http://127.0.0.1:PORT (...)"
        assert " on http://" in line, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.url = line.split(" on ")[1].split()[0]

    def stop(self) -> str:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def test_serve_answers_as_load_model_and_takes_in_training_steps_under_load(tmp_path: Path) -> None:
    model_dir, artifact = tmp_path / "m", tmp_path / "served"
    assert _train(model_dir, artifact, 1) == 0  # 47 steps: the artifact, then deltas
    rows = pd.read_csv(sample_path("clicks.csv")).drop(columns=["clicked"]).iloc[:64]
    body = {"rows": {c: [None if isinstance(v, float) and v != v else v for v in rows[c].tolist()] for c in rows}}
    server = _Server(artifact)
    try:
        code, first = _request(server.url + "/predict", body)
        assert code == 200
        model = et.load_model(artifact)
        assert first["step"] == model.step
        np.testing.assert_array_equal(np.array(first["predictions"], np.float32), model.predict(rows))
        instances = [{c: body["rows"][c][i] for c in body["rows"]} for i in range(3)]
        code, some = _request(server.url + "/predict", {"instances": instances})
        assert code == 200 and some["predictions"] == first["predictions"][:3]

        seen: list[tuple[int, tuple[float, ...]]] = []
        stop = threading.Event()
        failures: list[str] = []

        def client() -> None:
            while not stop.is_set():
                code, doc = _request(server.url + "/predict", body)
                if code != 200:
                    failures.append(str(doc))
                    return
                seen.append((doc["step"], tuple(doc["predictions"])))

        clients = [threading.Thread(target=client) for _ in range(4)]
        for c in clients:
            c.start()
        try:
            assert _train(model_dir, artifact, 2) == 0  # one more epoch, exported every 10 steps while served
            last = et.load_model(artifact)
            deadline = time.monotonic() + 30
            while _request(server.url + "/health")[1]["step"] != last.step and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            stop.set()
            for c in clients:
                c.join(timeout=60)
        assert not failures, failures[:3]
        by_step: dict[int, set[tuple[float, ...]]] = {}
        for step, preds in seen:
            by_step.setdefault(step, set()).add(preds)
        assert all(len(v) == 1 for v in by_step.values()), {k: len(v) for k, v in by_step.items()}  # none torn
        assert len(by_step) >= 2, sorted(by_step)  # steps were taken in while clients were answered
        code, final = _request(server.url + "/predict", body)
        assert final["step"] == last.step > first["step"]
        np.testing.assert_array_equal(np.array(final["predictions"], np.float32), last.predict(rows))

        code, health = _request(server.url + "/health")
        assert code == 200 and health["status"] == "ok" and health["updates"] >= 1 and health["errors"] == 0
        assert health["requests"] >= len(seen) and health["latency_ms"]["p99"] >= health["latency_ms"]["p50"] > 0
        assert 0 <= health["age_s"] < 120
        for bad, reason in (
            ({"rows": {"user": [1]}}, "no column"),
            ({"what": 1}, 'needs "rows" or "instances"'),
            ({"rows": {"user": 3}}, "one value per row"),
        ):
            code, doc = _request(server.url + "/predict", bad)
            assert code == 400 and reason in doc["error"], doc
        code, doc = _request(server.url + "/nothing")
        assert code == 404
        _, health = _request(server.url + "/health")
        assert health["errors"] == 3
        _one_piece_responses(server.url)
        _refusals_leave_the_connection_sane(server.url)
    finally:
        err = server.stop()
    assert "now serving step" in err and "Traceback" not in err, err[-2000:]


def _one_piece_responses(url: str) -> None:
    """Each response of a keep-alive connection arrives whole in one read: the server writes headers and body
    together (written apart, the body waits for the client's delayed ACK of the headers, about 40 ms a request)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        for _ in range(3):
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            data = sock.recv(1 << 16)  # what has arrived once anything has
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
                b"content-length")))  # fmt: skip
            assert len(body) == length and json.loads(body)["status"] == "ok", data


def _exchange(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Send ``request``; its response's status, headers (lower-case names) and JSON body."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(1 << 16)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(1 << 16)
    return int(lines[0].split()[1]), headers, json.loads(body)


def _refusals_leave_the_connection_sane(url: str) -> None:
    """A request refused before its body is read (an unknown path, a method not served, a chunked or unsized body)
    gets a JSON answer and ends its connection: kept alive, the unread body would be read as the next request.
    A body that was read and refused (not JSON) keeps the connection for the next request."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = b'{"rows": {}}'
    sized = f"Host: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    cases = [
        (b"POST /nothing HTTP/1.1\r\n" + sized, 404, "no such endpoint"),
        (b"DELETE /predict HTTP/1.1\r\n" + sized, 405, "method DELETE is not served"),
        (b"PUT /predict HTTP/1.1\r\n" + sized, 405, "method PUT is not served"),
        (
            f"POST /predict HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n\r\nc\r\n".encode()
            + body
            + b"\r\n0\r\n\r\n",
            411,
            "chunked",
        ),
        (f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Length: x\r\n\r\n".encode() + body, 400, "invalid"),
    ]
    for request, status, reason in cases:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            code, headers, doc = _exchange(sock, request)
            assert code == status and reason in doc["error"] and headers.get("connection") == "close", (code, doc)
            assert status != 405 or headers["allow"] == "GET, POST"
            assert sock.recv(1 << 16) == b""  # closed by the server
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        bad = f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Length: 8\r\n\r\nnot json".encode()
        code, headers, doc = _exchange(sock, bad)
        assert code == 400 and "connection" not in headers
        code, _, doc = _exchange(sock, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert code == 200 and doc["status"] == "ok"


def test_serve_refuses_what_is_not_an_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["serve", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.json is missing" in err and len(err.splitlines()) == 1
