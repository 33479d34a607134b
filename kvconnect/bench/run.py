"""`kvconnect bench`: pull KV-shaped requests between two processes and report throughput against a
copy ceiling measured in the same run.

The prefill side runs in a spawned process with its own connector (NIXL agent, ZMQ side channel on
127.0.0.1) and leases blocks on request; the decode side, in this process, pulls them through the
public connector API (`lease` -> `pull` -> `PullHandle.wait`) and verifies every byte. One *case* is a
(layout pair, request length, block-id pattern); both sides get a fresh cache and connector per case,
so each case reports its own first-contact cost. See `bench_pull.py` for the two sides and
`bench_report.py` for the table, JSON and plot.

    kvconnect bench --model llama-3-8b --tokens 4096 --pattern scattered --reps 5 \\
        --json results/cpu/x.json --plot results/cpu/x.png
    kvconnect bench --prefill-device cuda:0 --decode-device cuda:1 --tokens 256,1024,4096 \\
        --ucx UCX_CUDA_IPC_MAX_STREAMS=4
    kvconnect bench --tokens 1024 --tp 1:2,2:1 --token-layouts NHD:NHD,HND:HND --decode-block-size 64 \\
        --hetero-path auto,direct,staging

Heterogeneous pairs (`--tp`, `--token-layouts`, `--decode-block-size`, `--hetero-path`): the benchmark
process is decode rank 0 of the decode TP group and reads every prefill rank it needs, one process per
rank; rates then count decode rank 0's useful bytes, and the staging path's scatter is part of the time.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from importlib import metadata

import msgspec
import numpy as np

from kvconnect.bench.args import add_arguments as add_arguments  # the CLI finds a subcommand's flags here
from kvconnect.bench.args import check_tp_pairs, options_from_args
from kvconnect.bench.report import SCHEMA, BenchOptions, BenchReport
from kvconnect.core.errors import ConfigError, KVConnectError

log = logging.getLogger(__name__)

# --- running -------------------------------------------------------------------------------------


@contextlib.contextmanager
def exported(env: dict[str, str]) -> Iterator[None]:
    """Set environment variables (UCX reads them when an agent is created) and restore them after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def transport_env() -> dict[str, str]:
    """The variables that shape NIXL/UCX (no hostnames, no secrets)."""
    return {
        k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "NIXL_")) or k == "CUDA_VISIBLE_DEVICES"
    }


def system_info(opts: BenchOptions) -> dict[str, str]:
    import torch

    from kvconnect.core.agent import nixl_module

    build = nixl_module()[0].__name__.split(".")[0]
    info = {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu_count": str(os.cpu_count()),
        "cpu_model": _cpu_model(),
        "torch": str(torch.__version__),
        "numpy": str(np.__version__),
        "nixl_build": build,
        "nixl": _dist_version(build.replace("_", "-")),
        "kvconnect": _dist_version("kvconnect"),
    }
    for side in ("prefill", "decode"):
        dev = getattr(opts, f"{side}_device")
        if dev.startswith("cuda"):
            info[f"{side}_gpu"] = torch.cuda.get_device_name(torch.device(dev))
            info["torch_cuda"] = str(torch.version.cuda)
    return info


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _invoked_command() -> list[str]:
    argv = sys.argv[1:]
    return ["kvconnect", *argv[argv.index("bench") :]] if "bench" in argv else []


def run_bench(opts: BenchOptions, command: list[str] | None = None) -> BenchReport:
    """Run every case; raises KVConnectError (a byte mismatch included) on the first failure."""
    import torch
    from tqdm import tqdm

    from kvconnect.bench.cases import plan_cases
    from kvconnect.bench.pull import PrefillGroup, measure_case
    from kvconnect.core.config import ConnectorConfig

    if opts.decode_device.startswith("cuda"):
        torch.cuda.set_device(torch.device(opts.decode_device))  # before the connector exists
    exporting = "nixl" if opts.transports == ["nixl"] else "auto"  # prefill: offer CUDA IPC handles?
    decode_cfg = ConnectorConfig(
        engine_id="bench-decode",
        side_channel_host="127.0.0.1",
        confirm_reads=opts.confirm,
        nixl_threads=opts.nixl_threads,
        telemetry=opts.telemetry,
        pull_timeout_s=opts.pull_timeout_s,
        lease_ttl_s=max(60.0, 2 * opts.pull_timeout_s),
    )
    prefill_cfg = msgspec.structs.replace(decode_cfg, engine_id="bench-prefill", transport=exporting)
    check_tp_pairs(opts.tp_pairs, opts.geometry.num_kv_heads)
    cases = plan_cases(opts)
    report = BenchReport(SCHEMA, command or [], opts, transport_env(), system_info(opts))
    pulls_per_case = 1 + opts.warmup + opts.reps
    bar = tqdm(
        total=len(cases) * pulls_per_case,
        unit="pull",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=(not sys.stderr.isatty()) if opts.progress is None else not opts.progress,
    )
    group = PrefillGroup(transport_env(), opts.prefill_device, prefill_cfg)
    try:
        group.take(1)
        for index, key in enumerate(cases):
            bar.set_postfix_str(key.label)
            case = measure_case(group, opts, index, key, decode_cfg, lambda: bar.update(1))
            report.cases.append(case)
            log.info(
                "%s: %.2f GB/s (%.0f%% of %.2f), %d descs -> %d, path %s",
                key.label,
                case.gbps_median,
                case.pct_of_ceiling,
                case.ceiling.gbps_median,
                case.num_descs,
                case.num_descs_merged,
                case.path,
            )
    finally:
        bar.close()
        group.stop()
    return report


def run(args: argparse.Namespace) -> int:
    from kvconnect.bench.plot import write_plot
    from kvconnect.bench.report import write_json
    from kvconnect.bench.table import format_table

    try:
        opts = options_from_args(args)
    except ConfigError as e:
        log.error("kvconnect bench: %s", e)
        return 2
    try:
        with exported({"NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN"), **opts.ucx_env}):
            report = run_bench(opts, _invoked_command())
    except KVConnectError as e:
        log.error("kvconnect bench failed: %s", e)
        return 1
    if report.command:
        print("$ " + shlex.join(report.command))
    print(format_table(report), flush=True)
    if args.json:
        write_json(report, args.json)
    if args.plot:
        write_plot(report, args.plot)
    return 0
