"""What the checks before a pull exists cost on the engine's thread: a vLLM worker (`KVConnectWorker`, CPU cache shaped
as vLLM's) pulling `--blocks` blocks at a time from a prefill process over NIXL, with each step of its
`bind_connector_metadata` timed as it runs (the worker pairing its prefix-cache hit with the prefill's tail, the
connector validating the params and building the pull). Medians over `--pulls` pulls, each a fresh lease; the
floor printed is the whole `_start` (the worker's start of one pull), and each row gives its share.

    python benchmarks/pull_checks_cost.py [--blocks 256] [--pulls 30]
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
import time
from typing import Any

import kvconnect.core.decode.handle as decode_handle
import kvconnect.core.decode.pull as decode_pull
import kvconnect.core.plan.params as plan_params
import kvconnect.vllm.worker as worker_module
from kvconnect.core.config import connector_config
from kvconnect.core.connector import KVConnector
from kvconnect.core.decode.puller import Puller
from kvconnect.harness.prefill import PrefillProcess
from kvconnect.harness.vllm_shapes import packed_views
from kvconnect.vllm.metadata import PullOrder, StepOrders

STEPS = (  # (what, owner, attribute): timed where they run
    ("worker: the whole start of a pull", worker_module.KVConnectWorker, "_start"),
    ("worker: pair the local hit with the prefill's tail", worker_module, "tail_pairs"),
    ("connector: pull()", KVConnector, "pull"),
    ("connector: prepare", Puller, "prepare"),
    ("  Pull.from_params", decode_pull.Pull, "from_params"),
    ("    validated_pull", decode_pull, "validated_pull"),
    ("      validate_block_ids (each)", plan_params, "validate_block_ids"),
    ("    PullHandle()", decode_handle, "PullHandle"),
)


def timed(took: dict[str, list[int]], what: str, owner: Any, name: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            took[what].append(time.perf_counter_ns() - t0)

    setattr(owner, name, wrapper)  # (a classmethod read off its class is bound already: the wrapper calls it so)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--pulls", type=int, default=30)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    n, num_blocks = args.blocks, 2 * args.blocks + 100
    pre = PrefillProcess.launch(kv_digest=False)
    try:
        pre.wait_started()
        geometry = dict(layers=2, blocks=num_blocks, heads=2, tokens=16, head_dim=32, page="vllm:cpu-vec")
        pre.setup_views("LBHNC", geometry, 4)
        pre.wait_setup()
        views, _ = packed_views("LBHNC", 2, num_blocks, 2, 16, 32, seed=1)
        config = connector_config({}, side_channel_host="127.0.0.1", kv_digest=False)
        worker = worker_module.KVConnectWorker(config, tp_rank=0, total_kv_heads=2)
        worker.register_kv_caches(views, num_blocks=num_blocks, block_size=16, tp_size=1, page="vllm:cpu-vec")
        conn = worker.connector
        assert conn is not None
        conn.pull(pre.lease("first contact", [1], 16), [1]).wait(30)
        took: dict[str, list[int]] = collections.defaultdict(list)
        for what, owner, name in STEPS:
            timed(took, what, owner, name)
        for i in range(args.pulls):
            params = pre.lease(f"r{i}", list(range(n, 2 * n)), n * 16)
            order = PullOrder(f"r{i}", params, [list(range(10, 10 + n))], n * 16, 0)
            worker.bind_connector_metadata(StepOrders(pulls=[order], idle=True))
            while not worker.transfer_results(set())[1]:
                pass
        whole = statistics.median(took[STEPS[0][0]])
        print(f"{n} blocks, {args.pulls} pulls: median us per call (share of the worker's whole start)")
        for what, _, _ in STEPS:
            med = statistics.median(took[what])
            print(f"  {what:52s} {med / 1000:8.1f}  {100 * med / whole:5.1f} %")
        worker.close()
    finally:
        pre.stop()


if __name__ == "__main__":
    main()
