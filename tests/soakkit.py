"""The soak's second attacker (tests/test_soak.py): the third security review's attacks, mixed into the load.

- swap: a prefill leg for prompt k, then its params sent with prompt j to both decodes: refused, or (decode-r
  recomputes) j's own tokens; never k's;
- incarnation: the params of a real leg with a made-up `remote_incarnation_id`: that request fails alone or
  recomputes; the real params still read right or are refused, never wrong;
- engine flood: params naming made-up engine ids at the real prefill's address;
- leg only: prefill legs nobody decodes (a client that leaves after the first leg): their leases must end;
- half-sent: raw connections to the prefill's side channel that greet as a ZMQ DEALER, announce a 200 KiB
  frame and send half of it, kept open (a slow loris before authentication).

Anything that must never happen goes to `bad`; what was done is counted in `counts`.
"""

from __future__ import annotations

import collections
import os
import random
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx

from tests.faultkit import health

HALF_SENT_OPEN = 16  # raw connections kept half-sent at once
HALF_FRAME_BYTES = 200 * 1024  # under the side channel's 256 KiB cap for unauthenticated frames


def _other_char(c: str) -> str:
    """A character other than `c` (a forgery that equals the original is no forgery: ids start with any char)."""
    return "y" if c == "x" else "x"


def zmtp_greeting() -> bytes:
    """ZMTP 3.0 greeting (NULL mechanism) and READY command of a DEALER socket."""
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    body = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    return greeting + b"\x04" + bytes([len(body)]) + body


class MoreAttacks:
    """A thread per attack above, each every 0.1 s, until stopped."""

    KINDS = ("swap", "incarnation", "engine_flood", "leg_only", "forged_params")
    # signed fields a forger changes (or the signature dropped): the decode must refuse every one before it dials
    FORGERIES: tuple[tuple[str, Callable[[dict[str, Any]], Any]], ...] = (
        ("remote_block_ids", lambda p: [b + 1 for b in p["remote_block_ids"]]),
        ("remote_lease_id", lambda p: _other_char(p["remote_lease_id"][0]) + p["remote_lease_id"][1:]),
        ("remote_host", lambda p: "localhost"),
        ("remote_expires_ms", lambda p: p["remote_expires_ms"] + 3_600_000),
        ("remote_prompt_digest", lambda p: "0" * 32),
        ("remote_engine_id", lambda p: "forged-" + p["remote_engine_id"]),
        ("remote_key_id", lambda p: "00000000"),
        ("remote_mac", lambda p: None),
    )

    def __init__(
        self,
        urls: dict[str, str],
        prompts: list[str],
        expected: Callable[[int], list[int]],
        max_tokens: Callable[[int], int],
        seed: int,
    ) -> None:
        self.urls, self.prompts, self.expected, self.max_tokens = urls, prompts, expected, max_tokens
        self.rng = random.Random(seed)
        self.stop_event = threading.Event()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bad: list[str] = []
        self.errors: list[str] = []
        self.half_sent: list[socket.socket] = []
        self.threads = [
            threading.Thread(target=self._run, args=(kind,), daemon=True) for kind in (*self.KINDS, "half_sent")
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(180)
        for s in self.half_sent:
            s.close()
        self.half_sent.clear()

    def _leg(self, k: int) -> dict[str, Any] | None:
        r = httpx.post(
            self.urls["prefill"] + "/v1/completions",
            json={"prompt": self.prompts[k], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
            timeout=30,
        )
        return r.json()["kv_transfer_params"] if r.status_code == 200 else None  # (None: the prefill restarts)

    def _decode(self, name: str, k: int, params: dict[str, Any], what: str) -> None:
        """Send prompt k with `params` to decode `name`: a 200 must carry k's own tokens."""
        body = {
            "prompt": self.prompts[k],
            "max_tokens": self.max_tokens(k),
            "return_token_ids": True,
            "kv_transfer_params": params,
        }
        r = httpx.post(self.urls[name] + "/v1/completions", json=body, timeout=60)
        if r.status_code == 200:
            self.counts[f"{what}_answered"] += 1
            if r.json()["choices"][0]["token_ids"] != self.expected(k):
                self.bad.append(f"{what} at {name}: tokens other than prompt {k}'s own")
        else:
            self.counts[f"{what}_refused"] += 1

    def _forged(self, name: str, k: int, params: dict[str, Any], field: str) -> None:
        """Params with one signed field forged: refused by name (a 400), never answered."""
        body = {"prompt": self.prompts[k], "max_tokens": self.max_tokens(k), "kv_transfer_params": params}
        r = httpx.post(self.urls[name] + "/v1/completions", json=body, timeout=60)
        if r.status_code == 400 and "kv_transfer_params.remote_" in r.text:
            self.counts["forged_params_refused"] += 1
        else:
            self.bad.append(f"params forged in {field} at {name}: {r.status_code} {r.text[:200]}")

    def _run(self, kind: str) -> None:
        n = 0
        while not self.stop_event.wait(0.1):
            n += 1
            try:
                if kind == "half_sent":
                    self._half_sent()
                    continue
                k = self.rng.randrange(len(self.prompts))
                params = self._leg(k)
                if params is None:
                    continue
                self.counts[kind] += 1
                if kind == "swap":
                    j = (k + 1 + self.rng.randrange(len(self.prompts) - 1)) % len(self.prompts)
                    for name in ("decode-r", "decode"):
                        self._decode(name, j, params, "swap")
                elif kind == "incarnation":
                    self._decode("decode-r", k, {**params, "remote_incarnation_id": os.urandom(6).hex()}, kind)
                    self._decode("decode", k, params, "incarnation_real")
                elif kind == "forged_params":
                    field, forge = self.FORGERIES[n % len(self.FORGERIES)]
                    forged = {**params, field: forge(params)}
                    for name in ("decode-r", "decode"):
                        self._forged(name, k, {f: v for f, v in forged.items() if v is not None}, field)
                elif kind == "engine_flood":
                    for i in range(4):
                        forged = {**params, "remote_engine_id": f"flood-{n}-{i}-{os.urandom(3).hex()}"}
                        self._decode("decode", k, forged, kind)
                # ("leg_only": nothing follows the leg)
            except (httpx.HTTPError, KeyError, ValueError, OSError) as e:
                self.counts["attack_errors"] += 1  # (a worker restarting; not a finding)
                if len(self.errors) < 5:
                    self.errors.append(f"{kind}: {type(e).__name__}: {e}"[:200])

    def _half_sent(self) -> None:
        """Open one more half-sent connection to the prefill's side channel (closing the oldest beyond the cap)."""
        port = health(self.urls["prefill"])["side_channel_port"]
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.sendall(zmtp_greeting() + b"\x02" + HALF_FRAME_BYTES.to_bytes(8, "big") + bytes(HALF_FRAME_BYTES // 2))
        self.half_sent.append(s)
        self.counts["half_sent"] += 1
        while len(self.half_sent) > HALF_SENT_OPEN:
            self.half_sent.pop(0).close()
