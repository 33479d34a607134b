"""vLLM's benchmark client (`vllm bench serve`) kept in one process for many runs.

A fresh client per run spends ~20 s importing vLLM and loading the tokenizer before its requests (run9 of
results/gpu/serve: 26-36 s of wall time per run of ~8 s of requests). This client imports it once: the child
(`python -m kvconnect.bench.serve_client ACK_FD`) reads one JSON object per line on stdin, `{"argv": [...],
"log": PATH}`, runs vLLM's `main` on those arguments with its printout into PATH, and answers on the pipe ACK_FD
with `{"ok": true}` or `{"ok": false, "error": ...}` (its stdout is not used for answers: vLLM's logging writes
there). vLLM's `main` seeds Python's and numpy's generators from `--seed` at each call, so a run's prompts are
those a fresh client would draw.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import IO


class ServeClient:
    """The resident client as seen from the benchmark: `run` one client run, `close` at the end."""

    def __init__(self, log: Path, env: dict[str, str] | None = None) -> None:
        self._ack_r, ack_w = os.pipe()
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 (closed in close())
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvconnect.bench.serve_client", str(ack_w)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            pass_fds=(ack_w,),
            env=env,
        )
        os.close(ack_w)

    def run(self, argv: list[str], log: Path, timeout_s: float = 600.0) -> None:
        """One client run; raises RuntimeError when it failed, the child died or it ran past `timeout_s`."""
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._ack_r], [], [], timeout_s)
        line = _read_line(self._ack_r) if ready else ""
        if not line:
            raise RuntimeError(f"resident client: no answer within {timeout_s:.0f} s (exit code {self._proc.poll()})")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise RuntimeError(f"resident client: {answer.get('error')}")

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        os.close(self._ack_r)
        self._log.close()


def _read_line(fd: int) -> str:
    out = b""
    while not out.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace").strip()


def _serve(ack_fd: int) -> None:
    """The child: vLLM's client parser and main, once imported, for every line on stdin."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with os.fdopen(ack_fd, "w") as ack:
        for line in sys.stdin:
            if not line.strip():
                continue
            order = json.loads(line)
            try:
                parser = FlexibleArgumentParser()
                add_cli_args(parser)
                with open(order["log"], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                    main(parser.parse_args(order["argv"]))
                answer: dict[str, object] = {"ok": True}
            except BaseException as e:  # (SystemExit from argparse included: the parent decides)
                answer = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            ack.write(json.dumps(answer) + "\n")
            ack.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
