"""The failure table's machinery (tests/test_vllm_failures.py): the connectors compared, the servers each runs,
one aggregated reference for every answer, requests judged against it, the rows recorded, and the columns'
servers on two network namespaces joined by a veth whose link a test can cut (`kvconnect.harness.netns`).

A column is one connector at its default settings: kvconnect (`KVConnectConnector`), vLLM's NixlConnector and
vLLM's NixlPushConnector, the two NIXL ones with their thread pinning undone (`kvconnect.bench.nixl_fair`: on a
2-core machine it puts prefill and decode on one core and starves it); their prefills keep NIXL's progress thread
(over TCP a prefill must progress to serve a READ), their decodes run without it, as in the head-to-head (their
engines drive progress while a load is pending). Each prefill runs its
connector's tamper variant (`tests.vllm_tamper`: the shipped connector, plus a file a test can drop
to scramble blocks) with a small cache (`PREFILL_BLOCKS`, so that other requests rewrite freed blocks within a
few requests) and prompt embeddings enabled; its UCX runs over TCP only, so that a stopped prefill really holds
a READ in flight. kvconnect's prefill has `kv_digest` on (it sums the blocks it leases: that changes no answer,
it only lets a decode that asks check them); its `decode` has it off, as by default, and a second decode,
`decode-d`, has it on.

An answer is judged against the aggregated server's answer to the same prompt (greedy, float32, 8 tokens):
- `correct`: a 200 with the reference's tokens, the prompt's KV loaded from the prefill;
- `recomputed`: a 200 with the reference's tokens, the decode computed the prompt itself (no KV loaded);
- `refused`: an error status, no tokens;
- `WRONG`: a 200 whose tokens are not the reference's;
- `no answer`: none within the client's deadline (the request was then aborted by disconnecting).
"""

from __future__ import annotations

import base64
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvconnect.harness.net import free_port, poll_until
from kvconnect.harness.netns import Hosts
from kvconnect.harness.netns import NetnsCluster as NetnsCluster  # (re-exported for the failure table)
from kvconnect.harness.netns import enter_netns as enter_netns
from kvconnect.harness.netns import ip as ip
from kvconnect.harness.netns import netns_unavailable as netns_unavailable
from kvconnect.harness.tiny_llama import TinyLlama, build, prompt_of
from kvconnect.harness.vllm_cluster import Server, VllmCluster, connector_json
from tests.faultkit import metric_sum
from tests.helpers import VLLM_DTYPE

MAX_TOKENS = 8
MAX_MODEL_LEN = 2048
BLOCK = 32
PREFILL_BLOCKS = 256  # the prefill's cache: 8,192 tokens, rewritten by a few requests once freed
PROMPT_TOKENS = 300  # the cases' prompts: 9 full blocks and a partial one
TAMPER = "tests.vllm_tamper"
FAIR = "kvconnect.bench.nixl_fair"
NIXL_LEASE_S = 30.0  # NixlConnector's kv_lease_duration default (its prefill frees unread blocks after it)
KVCONNECT_LEASE_S = 60.0  # kvconnect's lease_ttl_s default


# --- answers ------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int  # 0: no answer within the client's deadline
    token_ids: list[int] | None = None
    error: str = ""
    elapsed_s: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None


def complete(
    url: str,
    prompt: list[int] | None,
    max_tokens: int = MAX_TOKENS,
    *,
    params: dict[str, Any] | None = None,
    request_id: str | None = None,
    timeout_s: float = 120.0,
    embeds: str | None = None,
    model: str = "tiny",
) -> Answer:
    """One greedy completion; `prompt` as token ids, or `embeds` (base64 of a saved tensor) instead; `model`: the
    served model's name, or a LoRA adapter's."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if embeds is not None:
        body["prompt_embeds"] = embeds
    else:
        body["prompt"] = prompt
    if params is not None:
        body["kv_transfer_params"] = params
    headers = {"x-request-id": request_id} if request_id else None
    t0 = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException:
        return Answer(0, error=f"no answer within {timeout_s:.0f} s", elapsed_s=time.monotonic() - t0)
    except httpx.TransportError as e:
        return Answer(-1, error=f"{type(e).__name__}: {e}", elapsed_s=time.monotonic() - t0)
    out = Answer(r.status_code, elapsed_s=time.monotonic() - t0)
    try:
        data = r.json()
    except ValueError:
        data = {}
    if r.status_code != 200:
        err = data.get("error") if isinstance(data, dict) else None
        out.error = str((err or {}).get("message") if isinstance(err, dict) else err or r.text)[:300]
        return out
    out.token_ids = data["choices"][0].get("token_ids")
    out.kv_transfer_params = data.get("kv_transfer_params")
    return out


def external_tokens(url: str) -> float:
    return metric_sum(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def prompt_tokens(url: str) -> float:
    return sum(
        metric_sum(url, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
    )


@dataclass
class Verdict:
    verdict: str  # correct, recomputed, refused, WRONG, no answer
    status: int
    detail: str = ""
    elapsed_s: float | None = None  # the request's, as the client saw it

    @property
    def wrong(self) -> bool:
        return self.verdict == "WRONG"


def judge(answer: Answer, want: list[int], loaded: float | None = None) -> Verdict:
    """`loaded`: prompt tokens the decode loaded for this request (None: not known)."""
    t = answer.elapsed_s
    if answer.status == 0:
        return Verdict("no answer", 0, answer.error, t)
    if answer.status != 200:
        return Verdict("refused", answer.status, answer.error, t)
    if answer.token_ids != want:
        return Verdict("WRONG", 200, f"tokens {answer.token_ids} instead of {want}", t)
    if loaded is not None and loaded <= 0:
        return Verdict("recomputed", 200, "the decode computed the prompt itself", t)
    return Verdict("correct", 200, "", t)


def decode_and_judge(url: str, prompt: list[int], want: list[int], **kw: Any) -> tuple[Answer, Verdict]:
    """A decode leg whose load is attributed by the decode's own counters (no other request in flight there)."""
    ext0, tok0 = external_tokens(url), prompt_tokens(url)
    answer = complete(url, prompt, params=kw.pop("params", None), **kw)
    loaded = None
    if answer.status == 200:
        poll_until(lambda: prompt_tokens(url) >= tok0 + len(prompt), timeout_s=30, what="the request's prompt counted")
        loaded = external_tokens(url) - ext0
    return answer, judge(answer, want, loaded)


# --- the columns ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    name: str  # kvconnect, nixl, push
    title: str
    prefill_class: str
    decode_class: str
    decode_module: str
    prefill_extra: dict[str, Any] = field(default_factory=dict)
    decode_extra: dict[str, Any] = field(default_factory=dict)
    digest_decode: bool = False  # a second decode with kv_digest on

    @property
    def nixl(self) -> bool:
        return self.name != "kvconnect"

    @property
    def push(self) -> bool:
        return self.name == "push"


COLUMNS = {
    "kvconnect": Column(
        "kvconnect",
        "kvconnect",
        "TamperKVConnectConnector",
        "KVConnectConnector",
        "kvconnect.vllm",
        prefill_extra={"kv_digest": True},
        decode_extra={"kv_digest": False},
        digest_decode=True,
    ),
    "nixl": Column("nixl", "NixlConnector", "TamperNixlConnector", "FairNixlConnector", FAIR),
    "push": Column("push", "NixlPushConnector", "TamperNixlPushConnector", "FairNixlPushConnector", FAIR),
}


def main_servers(column: Column, tamper_dir: Path, lora_dir: Path) -> list[Server]:
    """The column's prefill (core 0) and decodes (core 1) on loopback; the prefill also serves the LoRA adapter
    in `lora_dir` as `LORA`."""
    prefill_env = {"UCX_TLS": "tcp", "KVCONNECT_TAMPER_DIR": str(tamper_dir), "KVCONNECT_KV_DIGEST": "0"}
    decode_env = {"KVCONNECT_KV_DIGEST": "0"}
    if column.nixl:  # (NixlConnector's side channel: 5600 unless told)
        prefill_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    prefill_args = ["--num-gpu-blocks-override", str(PREFILL_BLOCKS), "--enable-prompt-embeds"]
    prefill_args += ["--enable-lora", "--lora-modules", f"{LORA}={lora_dir}", "--max-lora-rank", str(LORA_RANK)]
    servers = [
        Server(
            "prefill",
            connector_json(column.prefill_class, "kv_producer", TAMPER, column.prefill_extra),
            core=0,
            env=prefill_env,
            args=prefill_args,
        ),
        Server(
            "decode",
            connector_json(column.decode_class, "kv_consumer", column.decode_module, column.decode_extra),
            core=1,
            env={**decode_env, **({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} if column.nixl else {})},
        ),
    ]
    if column.digest_decode:
        servers.append(
            Server(
                "decode-d",
                connector_json(column.decode_class, "kv_consumer", column.decode_module, {"kv_digest": True}),
                core=1,
                env=decode_env,
            )
        )
    return servers


def cluster_of(model_dir: str, servers: list[Server], log_dir: Path) -> VllmCluster:
    return VllmCluster(model_dir, servers, str(log_dir), dtype=VLLM_DTYPE, max_model_len=MAX_MODEL_LEN)


# --- the reference and the prompts -------------------------------------------------------------------


class Reference:
    """The aggregated server (no connector), its tokenizer, and answers cached by prompt."""

    def __init__(self, model_dir: str, log_dir: Path) -> None:
        self.model_dir = model_dir
        self.cluster = cluster_of(model_dir, [Server("aggregated", None, core=0)], log_dir)
        self._answers: dict[tuple[int, ...], list[int]] = {}
        self._healthy = False

    @property
    def url(self) -> str:
        return self.cluster.urls["aggregated"]

    def start(self) -> Reference:
        """Start the server; `ready` waits for it (so that other servers can start meanwhile)."""
        self.cluster.start(wait=False)
        return self

    def ready(self) -> None:
        if not self._healthy:
            self.cluster.wait_healthy(["aggregated"])
            self._healthy = True

    def stop(self) -> None:
        self.cluster.stop()

    def tokens(self, n: int, seed: int) -> list[int]:
        """A prompt of exactly `n` token ids (the tiny models' frozen corpus, from a seeded place)."""
        words = 2 * n + 64
        while True:
            r = httpx.post(
                self.url + "/tokenize",
                json={"model": "tiny", "prompt": prompt_of(words, seed), "add_special_tokens": False},
                timeout=30,
            )
            r.raise_for_status()
            ids: list[int] = r.json()["tokens"]
            if len(ids) >= n:
                return ids[:n]
            words *= 2

    def answer(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._answers:
            got = complete(self.url, prompt)
            assert got.status == 200 and got.token_ids, got
            self._answers[key] = got.token_ids
        return self._answers[key]


def embeds_of(model_dir: str, token_ids: list[int]) -> str:
    """Prompt embeddings for vLLM's `prompt_embeds`: the checkpoint's own input embeddings of `token_ids`
    (float32), saved with torch and base64-encoded."""
    import torch
    from safetensors import safe_open

    path = next(Path(model_dir).glob("*.safetensors"))
    with safe_open(str(path), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    rows = table[torch.tensor(token_ids)].to(torch.float32).contiguous()
    buf = io.BytesIO()
    torch.save(rows, buf)
    return base64.b64encode(buf.getvalue()).decode()


LORA, LORA_RANK = "adapter", 8


def lora_adapter(out: Path, model: TinyLlama, rank: int = LORA_RANK) -> Path:
    """A LoRA adapter for the tiny Llama (PEFT's format), seeded, on its K and V projections: the KV of a prompt
    computed with it is not the base model's."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(7)
    kv_width = model.kv_heads * model.head_dim
    weights = {}
    for i in range(model.layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, model.hidden, generator=gen) * 0.1
            weights[f"{name}.lora_B.weight"] = torch.randn(kv_width, rank, generator=gen) * 0.1
    save_file(weights, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": ["k_proj", "v_proj"],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": "tiny",
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


# --- rows ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    connector: str
    case: str  # "1", "8a", ...
    what: str
    status: int
    verdict: str
    detail: str = ""
    test: str = ""  # the pytest node that produced it


def record(row: Row) -> None:
    """Append the row to the file `KVCONNECT_FAILURE_TABLE_OUT` names (benchmarks/failure_table.py renders it)."""
    out = os.environ.get("KVCONNECT_FAILURE_TABLE_OUT")
    print(f"[failure table] {row.connector:10} {row.case:4} {row.verdict:10} {row.status:4} {row.detail[:160]}")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(asdict(row)) + "\n")


# --- tampering ----------------------------------------------------------------------------------------


def permute_prefill_blocks(tamper_dir: Path, block_ids: list[int], nudge: Callable[[], Any]) -> None:
    """Have the prefill's worker permute these blocks' content across layers (tests.vllm_tamper),
    and wait until it did: the worker looks before each step, and `nudge` makes it step."""
    order = tamper_dir / "blocks.json"
    done = tamper_dir / "done.json"
    done.unlink(missing_ok=True)
    # whole or absent: the worker checks before every step, and a half-written order killed its engine
    staged = tamper_dir / "blocks.json.part"
    staged.write_text(json.dumps(block_ids))
    staged.replace(order)
    deadline = time.monotonic() + 60
    while not done.exists():
        assert time.monotonic() < deadline, "the prefill did not rewrite the blocks within 60 s"
        nudge()
    done.unlink()


# --- two hosts: kvconnect.harness.netns (Hosts, NetnsCluster), the columns' servers on them -----------


def netns_servers(column: Column, hosts: Hosts, secret_file: Path) -> list[Server]:
    """The column's prefill and decode, each on its host: KV and side channel over the veth (UCX over TCP on
    it), HTTP on each host's loopback. kvconnect's side channel then binds a routable address, which needs the
    secret: both sides hold one, so its params are signed too."""
    prefill_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": hosts.prefill_dev, "KVCONNECT_KV_DIGEST": "0"}
    decode_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": hosts.decode_dev, "KVCONNECT_KV_DIGEST": "0"}
    if column.nixl:
        prefill_env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=hosts.prefill_addr, VLLM_NIXL_SIDE_CHANNEL_PORT="5600")
        decode_env.update(VLLM_NIXL_SIDE_CHANNEL_HOST=hosts.decode_addr, VLLM_NIXL_SIDE_CHANNEL_PORT="5600")
        prefill_extra: dict[str, Any] = {}
        decode_extra: dict[str, Any] = {}
    else:
        prefill_extra = {"side_channel_host": hosts.prefill_addr, "secret_file": str(secret_file)}
        decode_extra = {"side_channel_host": hosts.decode_addr, "secret_file": str(secret_file)}
    module = "kvconnect.vllm" if not column.nixl else FAIR
    prefill_class = "KVConnectConnector" if not column.nixl else column.decode_class.replace("Fair", "Progress")
    return [
        Server("prefill", connector_json(prefill_class, "kv_producer", module, prefill_extra), core=0, env=prefill_env),
        Server(
            "decode", connector_json(column.decode_class, "kv_consumer", module, decode_extra), core=1, env=decode_env
        ),
    ]


def model_dir(root: Path) -> str:
    return str(build(root / "tiny-llama", TinyLlama.named("tiny")))


def iter_lines(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


# --- what the servers counted -------------------------------------------------------------------------

WATCHED = (
    "vllm:kvconnect_num_failed_pulls_total",
    "vllm:kvconnect_leases_ended_total",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_failed_notifications_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:nixl_num_notifications_after_expiry_total",
)
DROPPED_LABELS = {"engine", "model_name"}


def counters(urls: dict[str, str]) -> dict[str, float]:
    """The watched counters of each server (by name), keyed `server metric{labels}`."""
    from tests.faultkit import scrape

    out: dict[str, float] = {}
    for name, url in urls.items():
        for (metric, labels), value in scrape(url).items():
            if metric in WATCHED:
                shown = ",".join(f"{k}={v}" for k, v in labels if k not in DROPPED_LABELS)
                key = f"{name} {metric.removeprefix('vllm:').removesuffix('_total')}" + (
                    f"{{{shown}}}" if shown else ""
                )
                out[key] = out.get(key, 0.0) + value
    return out


def counted(before: dict[str, float], after: dict[str, float]) -> str:
    """What the servers counted between two `counters` readings, e.g. `decode kvconnect_num_failed_pulls{...} +1`."""
    parts = [f"{k} +{after[k] - before.get(k, 0.0):g}" for k in sorted(after) if after[k] > before.get(k, 0.0)]
    return "; ".join(parts)
