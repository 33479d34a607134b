"""`kvconnect bench`: argument handling, block-id draws, byte verification, and a tiny real run (two
processes, real NIXL) whose JSON and PNG are checked. No timed asserts."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from kvconnect import bench
from kvconnect.bench_pull import cache_blocks_for, draw_ids, verify
from kvconnect.bench_report import read_json
from kvconnect.cache import KVCache
from kvconnect.cli import build_parser, main
from kvconnect.errors import ConfigError, TransferError
from kvconnect.layout import CacheSpec, LayoutKind


def parse(*argv: str) -> argparse.Namespace:
    parser, _ = build_parser(["bench", *argv])
    return parser.parse_args(["bench", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-9b"], "invalid choice: 'llama-9b'"),
        (["--layouts", "kv_first:paged"], "bad layout pair 'kv_first:paged'"),
        (["--layouts", "kv_first:kv_first:kv_first"], "expected PREFILL:DECODE"),
        (["--pattern", "zigzag"], "bad pattern 'zigzag'"),
        (["--pattern", "runs:0"], "bad pattern 'runs:0'"),
        (["--tokens", "0"], "must be >= 1"),
        (["--tokens", "4096..256"], "runs backwards"),
        (["--ucx", "TLS=tcp"], "expected UCX_NAME=VALUE"),
        (["--prefill-device", "gpu0"], "expected cpu, cuda or cuda:N"),
        (["--transport", "rdma"], "bad transport"),
        (["--cache-factor", "0.5"], "must be >= 1.0"),
    ],
)
def test_bad_arguments_fail_with_a_clear_message(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_arguments_parse_into_options() -> None:
    opts = bench.options_from_args(parse(
        "--model", "llama-3-70b", "--tokens", "256..1024", "4096",
        "--layouts", "cross_layer,blocks_first:kv_first", "--pattern", "runs:1,runs:4,contiguous",
        "--ucx", "UCX_TLS=tcp,cma,self", "--no-confirm",
    ))
    assert (opts.geometry.num_layers, opts.geometry.num_kv_heads, opts.geometry.head_dim) == (80, 8, 128)
    assert opts.tokens == [256, 512, 1024, 4096]
    assert opts.layout_pairs == [("cross_layer", "cross_layer"), ("blocks_first", "kv_first")]
    assert opts.patterns == ["scattered", "runs:4", "contiguous"]
    assert opts.ucx_env == {"UCX_TLS": "tcp,cma,self"} and opts.confirm is False
    defaults = bench.options_from_args(parse())
    assert defaults.geometry.model == "llama-3-8b" and defaults.tokens == [4096]
    assert defaults.layout_pairs == bench.SAME_PAIRS and defaults.patterns == ["scattered"]
    assert defaults.confirm is True and defaults.transports == ["nixl"]
    assert (defaults.geometry.dtype, defaults.geometry.block_size) == ("bfloat16", 16)
    assert len(bench.parse_layout_pairs("all")) == 9


def test_geometry_needs_a_preset_or_all_three_dimensions() -> None:
    with pytest.raises(ConfigError, match="missing --num-kv-heads, --head-dim"):
        bench.geometry_from_args(parse("--num-layers", "2"))
    custom = bench.geometry_from_args(parse("--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8"))
    assert (custom.model, custom.num_layers, custom.head_dim) == ("custom", 2, 8)
    tweaked = bench.geometry_from_args(parse("--model", "small", "--num-layers", "7"))
    assert tweaked.num_layers == 7 and tweaked.model.startswith("small")
    assert main(["bench", "--num-layers", "2", "--no-progress"]) == 2  # reported, not raised


def test_ipc_transport_is_refused_on_dram() -> None:
    with pytest.raises(ConfigError, match="needs both sides on cuda"):
        bench.options_from_args(parse("--transport", "ipc"))


@pytest.mark.parametrize("pattern", ["scattered", "runs:4", "contiguous"])
@pytest.mark.parametrize("num_blocks", [1, 5, 16, 33])
def test_block_id_draws(pattern: str, num_blocks: int) -> None:
    cache_blocks = cache_blocks_for(pattern, num_blocks, 1.25)
    assert cache_blocks >= num_blocks
    rng = np.random.default_rng(num_blocks)
    for _ in range(5):
        ids = draw_ids(rng, pattern, num_blocks, cache_blocks)
        assert ids.size == num_blocks == np.unique(ids).size
        assert 0 <= ids.min() and ids.max() < cache_blocks
        if pattern == "contiguous":
            assert (np.diff(ids) == 1).all()
        elif pattern == "runs:4":
            runs = ids[: num_blocks - num_blocks % 4].reshape(-1, 4)
            assert (np.diff(runs, axis=1) == 1).all() and (runs[:, 0] % 4 == 0).all()


def test_verify_catches_a_single_wrong_byte() -> None:
    geometry = dict(dtype="bfloat16", num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)
    shadow = KVCache.allocate(CacheSpec(kind=LayoutKind.KV_FIRST, num_blocks=10, **geometry))
    shadow.fill_pattern(3)
    local = KVCache.allocate(CacheSpec(kind=LayoutKind.CROSS_LAYER, num_blocks=6, **geometry))
    local_ids, remote_ids = np.array([5, 0, 2]), np.array([1, 7, 4])
    for layer in range(2):
        for dst, src in zip(local.kv(layer), shadow.kv(layer), strict=True):
            dst[torch.as_tensor(local_ids)] = src[torch.as_tensor(remote_ids)]
    assert verify(local, shadow, local_ids, remote_ids) == 3 * local.spec.block_bytes
    local.kv(1)[1][0].view(torch.uint8).flatten()[17] ^= 1  # local block 0 <- remote block 7, layer 1, V
    with pytest.raises(TransferError, match=r"local block 0 <- remote block 7, layer 1 V"):
        verify(local, shadow, local_ids, remote_ids)


def test_tiny_real_run_writes_verified_json_and_plot(tmp_path, capsys) -> None:
    json_path, png_path = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    argv = ["bench", "--model", "small", "--tokens", "48,256", "--reps", "2", "--warmup", "0",
            "--no-progress", "--json", str(json_path), "--plot", str(png_path)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "kv_first:kv_first" in table and "cross_layer:cross_layer" in table and "byte-exact" in table
    report = read_json(json_path)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.options.geometry.num_layers == 4 and "nixl" in report.system
    assert len(report.cases) == 6
    for case in report.cases:
        assert case.verified_pulls == 3 and case.verified_bytes == 3 * case.bytes
        assert len(case.reps) == 2 and len(case.ceiling.reps_s) == 2
        assert case.gbps_median > 0 and case.ceiling.gbps_median > 0 and case.pct_of_ceiling > 0
        assert case.first_contact_s > 0 and case.transport_used == "nixl"
        assert case.num_descs_merged <= case.num_descs
        assert case.bytes_per_desc == case.bytes / case.num_descs_merged
    for tokens, num_blocks in ((48, 3), (256, 16)):
        by_pair = {c.prefill_layout: c for c in report.cases if c.tokens == tokens}
        assert by_pair["kv_first"].num_descs == 2 * by_pair["blocks_first"].num_descs == 2 * 4 * num_blocks
        assert by_pair["cross_layer"].num_descs == num_blocks
        assert {c.bytes for c in by_pair.values()} == {num_blocks * 32 * 1024}
        assert [c.granularity for c in by_pair.values()] == ["HALF", "LAYER", "BLOCK"]


def test_unconfirmed_runs_pattern_mixed_pair(tmp_path) -> None:
    json_path = tmp_path / "bench.json"
    argv = ["bench", "--model", "small", "--tokens", "128", "--pattern", "runs:4",
            "--layouts", "blocks_first:cross_layer,cross_layer", "--reps", "2", "--no-confirm",
            "--no-progress", "--json", str(json_path)]
    assert main(argv) == 0
    mixed, same = read_json(json_path).cases
    assert not read_json(json_path).options.confirm
    assert mixed.granularity == "LAYER" and mixed.num_descs == 4 * 8 and mixed.verified_pulls == 4
    assert same.granularity == "BLOCK" and same.num_descs == 8
    assert 1 <= same.num_descs_merged <= 2  # two runs of 4 blocks (adjacent on both sides by chance: one)
