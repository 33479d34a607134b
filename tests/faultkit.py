"""Helpers for fault-injection tests against real worker processes: polling, /health, /metrics, raw legs."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvconnect.harness.net import poll_until

__all__ = ["poll_until"]  # (re-exported: the tests import their helpers from here)


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=5).json()  # type: ignore[no-any-return]


def idle(url: str) -> bool:
    """No block allocated, leased or quarantined, nothing running."""
    h = health(url)
    return (
        h["free_blocks"] == h["total_blocks"]
        and h["leased_blocks"] == 0
        and h.get("quarantined_blocks", 0) == 0
        and h.get("running", 0) == 0
    )


def scrape(url: str, timeout_s: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=timeout_s).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(url: str, name: str, **labels: str) -> float:
    return scrape(url).get((name, tuple(sorted(labels.items()))), 0.0)


def metric_sum(url: str, name: str, timeout_s: float = 5.0, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels` (vLLM adds engine and model labels)."""
    return sum(v for (n, lab), v in scrape(url, timeout_s).items() if n == name and set(labels.items()) <= set(lab))


def prefill_leg(url: str, prompt: str, request_id: str) -> dict[str, Any]:
    """The proxy's first leg by hand: returns the kv_transfer_params the prefill worker leased."""
    leg = {"prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(url + "/v1/completions", json=leg, headers={"x-request-id": request_id}, timeout=60)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params and params["remote_request_id"] == request_id
    return params  # type: ignore[no-any-return]


def decode_leg(
    url: str, prompt: str, params: dict[str, Any] | None, max_tokens: int, request_id: str, timeout_s: float = 60
) -> dict[str, Any]:
    """The proxy's second leg by hand: {"status", "token_ids" or None, "error", "elapsed_s"}."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=body, headers={"x-request-id": request_id}, timeout=timeout_s)
    out: dict[str, Any] = {"status": r.status_code, "elapsed_s": time.monotonic() - t0, "token_ids": None}
    data = r.json()
    if r.status_code == 200:
        out["token_ids"] = data["choices"][0]["token_ids"]
    else:
        out["error"] = data["error"]["message"]
        out["param"] = data["error"].get("param")
    return out


def reference(url: str, prompt: str, max_tokens: int) -> list[int]:
    r = httpx.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]


def open_request(url: str, path: str, body: bytes, request_id: str) -> socket.socket:
    """Send one HTTP request on a raw socket and return it unread (close it to abort as a client does)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nx-request-id: {request_id}\r\nConnection: close\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def log_text(log_dir: str | None, name: str) -> str:
    assert log_dir, "the cluster was started without a log_dir"
    with open(os.path.join(log_dir, f"{name}.log"), errors="replace") as f:
        return f.read()
