"""`kvconnect bench`: argument handling, block-id draws, byte verification, and tiny real runs (real
processes, real NIXL) whose JSON and PNG are checked: homogeneous pairs, and heterogeneous ones (TP groups
with one process per prefill rank, block-size conversion, NHD/HND; block, direct and staging paths). No
timed asserts."""

from __future__ import annotations

import argparse

import msgspec
import numpy as np
import pytest
import torch

from kvconnect.bench import args as bench_args
from kvconnect.bench import run as bench
from kvconnect.bench.cases import CaseKey, cache_blocks_for, case_shape, draw_ids, plan_cases
from kvconnect.bench.pull import PrefillGroup, measure_case, verify, verify_tokens
from kvconnect.bench.report import BenchOptions, Geometry, read_json
from kvconnect.cli import build_parser, main
from kvconnect.core.cache import KVCache
from kvconnect.core.config import ConnectorConfig
from kvconnect.core.errors import ConfigError, TransferError
from kvconnect.core.plan.layout import CacheSpec, LayoutKind
from kvconnect.core.transports.staging import scatter

SMALL = Geometry(model="small", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16)


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
        (["--tp", "2:x"], "bad TP pair '2:x'"),
        (["--tp", "0:1"], "bad TP pair '0:1'"),
        (["--tp", "1:2:4"], "expected PREFILL:DECODE TP sizes"),
        (["--token-layouts", "NHD:DHN"], "bad token layout pair 'NHD:DHN'"),
        (["--hetero-path", "auto,fast"], "bad hetero path 'fast': expected auto, direct, staging"),
        (["--decode-block-size", "0"], "must be >= 1"),
        (["--merge", "on,maybe"], "bad --merge 'maybe': expected on, off or on,off"),
    ],
)
def test_bad_arguments_fail_with_a_clear_message(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_arguments_parse_into_options() -> None:
    opts = bench_args.options_from_args(
        parse(
            "--model",
            "llama-3-70b",
            "--tokens",
            "256..1024",
            "4096",
            "--layouts",
            "cross_layer,blocks_first:kv_first",
            "--pattern",
            "runs:1,runs:4,contiguous",
            "--ucx",
            "UCX_TLS=tcp,cma,self",
            "--no-confirm",
        )
    )
    assert (opts.geometry.num_layers, opts.geometry.num_kv_heads, opts.geometry.head_dim) == (80, 8, 128)
    assert opts.tokens == [256, 512, 1024, 4096]
    assert opts.layout_pairs == [("cross_layer", "cross_layer"), ("blocks_first", "kv_first")]
    assert opts.patterns == ["scattered", "runs:4", "contiguous"]
    assert opts.ucx_env == {"UCX_TLS": "tcp,cma,self"} and opts.confirm is False
    defaults = bench_args.options_from_args(parse())
    assert defaults.geometry.model == "llama-3-8b" and defaults.tokens == [4096]
    assert defaults.layout_pairs == bench_args.SAME_PAIRS and defaults.patterns == ["scattered"]
    assert defaults.confirm is True and defaults.transports == ["nixl"]
    assert (defaults.geometry.dtype, defaults.geometry.block_size) == ("bfloat16", 16)
    assert len(bench_args.parse_layout_pairs("all")) == 9


def test_geometry_needs_a_preset_or_all_three_dimensions() -> None:
    with pytest.raises(ConfigError, match="missing --num-kv-heads, --head-dim"):
        bench_args.geometry_from_args(parse("--num-layers", "2"))
    custom = bench_args.geometry_from_args(parse("--num-layers", "2", "--num-kv-heads", "1", "--head-dim", "8"))
    assert (custom.model, custom.num_layers, custom.head_dim) == ("custom", 2, 8)
    tweaked = bench_args.geometry_from_args(parse("--model", "small", "--num-layers", "7"))
    assert tweaked.num_layers == 7 and tweaked.model.startswith("small")
    assert main(["bench", "--num-layers", "2", "--no-progress"]) == 2  # reported, not raised


def test_ipc_transport_is_refused_on_dram() -> None:
    with pytest.raises(ConfigError, match="needs both sides on cuda"):
        bench_args.options_from_args(parse("--transport", "ipc"))


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
    argv = [
        "bench",
        "--model",
        "small",
        "--tokens",
        "48,256",
        "--reps",
        "2",
        "--warmup",
        "0",
        "--no-progress",
        "--json",
        str(json_path),
        "--plot",
        str(png_path),
    ]
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
        assert (case.path, case.num_sources, case.prefill_ranks, case.tp) == ("block", 1, 1, "1:1")
        assert case.useful_bytes == case.bytes and case.scatter_ms_median == 0 and not case.hetero
    assert "use MiB" not in table and "scat ms" not in table  # the homogeneous table is unchanged
    for tokens, num_blocks in ((48, 3), (256, 16)):
        by_pair = {c.prefill_layout: c for c in report.cases if c.tokens == tokens}
        assert by_pair["kv_first"].num_descs == 2 * by_pair["blocks_first"].num_descs == 2 * 4 * num_blocks
        assert by_pair["cross_layer"].num_descs == num_blocks
        assert {c.bytes for c in by_pair.values()} == {num_blocks * 32 * 1024}
        assert [c.granularity for c in by_pair.values()] == ["HALF", "LAYER", "BLOCK"]


def test_unconfirmed_runs_pattern_mixed_pair(tmp_path) -> None:
    json_path = tmp_path / "bench.json"
    argv = [
        "bench",
        "--model",
        "small",
        "--tokens",
        "128",
        "--pattern",
        "runs:4",
        "--layouts",
        "blocks_first:cross_layer,cross_layer",
        "--reps",
        "2",
        "--no-confirm",
        "--no-progress",
        "--json",
        str(json_path),
    ]
    assert main(argv) == 0
    mixed, same = read_json(json_path).cases
    assert not read_json(json_path).options.confirm
    assert mixed.granularity == "LAYER" and mixed.num_descs == 4 * 8 and mixed.verified_pulls == 4
    assert same.granularity == "BLOCK" and same.num_descs == 8
    assert 1 <= same.num_descs_merged <= 2  # two runs of 4 blocks (adjacent on both sides by chance: one)


def test_merge_off_issues_every_unit_apart_on_the_same_ids(tmp_path) -> None:
    """The same contiguous pulls with NIXL's merging on and off (real NIXL, its telemetry counting what it
    issued): on, 8 blocks of 4 layers go out as one descriptor per layer; off, as 32, and the stats say so.
    Shuffled cases run in an order drawn from the seed, every case still once."""
    argv = ["bench", "--model", "small", "--tokens", "128", "--pattern", "contiguous", "--layouts", "blocks_first"]
    argv += ["--merge", "on,off", "--telemetry", "--reps", "2", "--warmup", "0", "--no-progress"]
    assert main([*argv, "--json", str(tmp_path / "b.json")]) == 0
    report = read_json(tmp_path / "b.json")
    assert report.options.merges == [True, False] and report.options.telemetry
    merged, apart = report.cases
    assert (merged.label, apart.label) == ("blocks_first:blocks_first", "blocks_first:blocks_first merge off")
    assert (merged.num_descs, merged.num_descs_merged, merged.num_descs_issued) == (32, 4, 4)
    assert (apart.num_descs, apart.num_descs_merged, apart.num_descs_issued) == (32, 32, 32)
    assert apart.verified_bytes == merged.verified_bytes == 3 * apart.bytes
    keys = [bench_args.options_from_args(parse(*argv[1:], "--shuffle", "--seed", str(s))) for s in range(8)]
    orders = {tuple(k.label for k in plan_cases(o)) for o in keys}
    assert len(orders) == 2 and all(sorted(order) == sorted(next(iter(orders))) for order in orders)


# --- heterogeneous pairs -------------------------------------------------------------------------


def test_hetero_arguments_parse_into_options() -> None:
    opts = bench_args.options_from_args(
        parse(
            "--tp",
            "1:2,2:1,4",
            "--token-layouts",
            "nhd:hnd,HND",
            "--hetero-path",
            "direct,staging",
            "--decode-block-size",
            "64",
        )
    )
    assert opts.tp_pairs == [(1, 2), (2, 1), (4, 4)]
    assert opts.token_layouts == [("NHD", "HND"), ("HND", "HND")]
    assert opts.hetero_paths == ["direct", "staging"] and opts.hetero
    assert (opts.geometry.num_kv_heads, opts.geometry.block_size, opts.geometry.decode_block) == (8, 16, 64)
    defaults = bench_args.options_from_args(parse())
    assert (defaults.tp_pairs, defaults.token_layouts, defaults.hetero_paths) == ([(1, 1)], [("NHD", "NHD")], ["auto"])
    assert defaults.geometry.decode_block_size == 0 and not defaults.hetero
    assert bench_args.options_from_args(parse("--tp", "16:1,1:32")).tp_pairs == [(16, 1), (1, 32)]  # replication
    with pytest.raises(
        ConfigError,
        match="--tp: prefill tp_size 3 does not divide the model's 8 KV heads; decode tp_size 12 is not a multiple",
    ):
        bench_args.options_from_args(parse("--tp", "3:12"))
    assert main(["bench", "--tp", "3:1", "--no-progress"]) == 2  # reported, not raised


def test_case_shapes_choose_ranks_paths_and_staging_from_the_request() -> None:
    opts = BenchOptions(
        geometry=SMALL,
        tokens=[100],
        layout_pairs=[("cross_layer", "cross_layer")],
        patterns=["scattered"],
        tp_pairs=[(1, 1), (2, 1), (4, 1), (1, 2)],
        hetero_paths=["auto", "direct", "staging"],
    )
    keys = plan_cases(opts)
    # equal blocks: every path is the block path (one case); a forced path auto takes anyway runs once
    assert [(k.tp, k.hetero_path) for k in keys] == [
        ((1, 1), "auto"),
        ((2, 1), "auto"),
        ((2, 1), "direct"),
        ((4, 1), "auto"),
        ((4, 1), "direct"),
        ((1, 2), "auto"),
        ((1, 2), "direct"),
    ]
    replicated = case_shape(SMALL, keys[3], 1.25)  # 4 prefill ranks over 2 heads: two copies of each head
    assert sorted(replicated.prefill) == [0, 1, 2, 3] and replicated.sources.release_only == (1, 3)
    assert [(s.rank, s.heads, s.readers) for s in replicated.reads] == [(0, (0, 1), 1), (2, (1, 2), 1)]
    assert replicated.paths("auto") == ("staging", "staging") and replicated.staging_mb == 1
    half = case_shape(SMALL, keys[5], 1.25)  # decode rank 0 of 2 reads head 0 of the only prefill rank
    assert [(s.rank, s.heads, s.readers) for s in half.reads] == [(0, (0, 1), 2)]
    assert half.useful_bytes == 100 * 4 * 2 * 1 * 64 * 2 and half.num_blocks == (7, 7) and not half.plain
    big = msgspec.structs.replace(SMALL, num_layers=80, decode_block_size=64)
    shape = case_shape(big, CaseKey("cross_layer", "kv_first", "scattered", 4096, "nixl"), 1.25)
    assert shape.num_blocks == (256, 64) and shape.staging_mb * 2**20 >= 256 * shape.prefill[0].block_bytes


def test_verify_tokens_catches_a_single_wrong_byte() -> None:
    """Decode rank 0 (HND, block 64) of TP 1 holds both heads; each comes from one of two NHD prefill ranks."""

    def spec(tp: int, rank: int, block: int, order: str, blocks: int) -> CacheSpec:
        return CacheSpec(
            kind=LayoutKind.CROSS_LAYER,
            dtype="bfloat16",
            num_layers=2,
            num_blocks=blocks,
            block_size=block,
            num_kv_heads=2 // tp,
            head_dim=8,
            tp_size=tp,
            tp_rank=rank,
            token_layout=order,
            total_kv_heads=2,
        )

    local = KVCache.allocate(spec(1, 0, 64, "HND", 4))
    shape = case_shape(
        msgspec.structs.replace(SMALL, decode_block_size=64),
        CaseKey("cross_layer", "cross_layer", "scattered", 100, "nixl", (2, 1)),
        1.25,
    )
    shadows = {}
    local_ids, remote_ids = np.array([3, 0]), np.array([8, 1, 5, 0, 2, 9, 4])
    for src in shape.reads:
        shadows[src.rank] = KVCache.allocate(spec(2, src.rank, 16, "NHD", 10))
        shadows[src.rank].fill_pattern(src.rank + 1)
        scatter(shadows[src.rank], remote_ids, local, local_ids, 100, src.heads)
    assert verify_tokens(local, local_ids, shadows, shape.reads, remote_ids, 100) == 100 * 2 * 2 * 2 * 8 * 2
    local.kv(1)[1][0, 6, 1].view(torch.uint8)[3] ^= 1  # token 70: local block 0 slot 6, layer 1, V, head 1
    with pytest.raises(
        TransferError,
        match=r"token 70 \(local block 0 <- prefill rank 1 block 2\), layer 1 V, "
        r"heads \[1,2\) \(1 of 100 tokens differ\)",
    ):
        verify_tokens(local, local_ids, shadows, shape.reads, remote_ids, 100)


def test_tp_groups_through_the_cli_staging_and_direct(tmp_path, capsys) -> None:
    json_path, png_path = tmp_path / "hetero.json", tmp_path / "hetero.png"
    argv = [
        "bench",
        "--model",
        "small",
        "--tokens",
        "100",
        "--tp",
        "2:1,1:2",
        "--token-layouts",
        "NHD:NHD,HND:HND",
        "--layouts",
        "cross_layer",
        "--hetero-path",
        "staging,direct",
        "--reps",
        "2",
        "--warmup",
        "0",
        "--no-progress",
        "--json",
        str(json_path),
        "--plot",
        str(png_path),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "wire MiB" in table and "use MiB" in table and "scat ms" in table and "byte-exact" in table
    report = read_json(json_path)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.options.tp_pairs == [(2, 1), (1, 2)]
    paths = {(c.tp, c.token_layouts, c.hetero_path): c.path for c in report.cases}  # (auto's pick: test_hetero)
    assert paths == {
        (tp, order, path): path
        for tp in ("2:1", "1:2")
        for order in ("NHD:NHD", "HND:HND")
        for path in ("staging", "direct")
    }
    block = 32 * 1024  # a 16-token block of the whole model (2 heads)
    for c in report.cases:
        heads = 2 // c.decode_tp
        assert c.useful_bytes == 100 * 4 * 2 * heads * 64 * 2 == c.ceiling.bytes
        assert c.verified_pulls == 3 and c.verified_bytes == 3 * c.useful_bytes
        assert c.num_sources == c.prefill_ranks == c.prefill_tp and c.num_blocks == 7
        assert (c.scatter_ms_median > 0) == (c.path == "staging") and c.hetero and c.blocks == "16:16"
        assert c.num_descs_merged <= c.num_descs and c.gbps_median > 0 and c.pct_of_ceiling > 0
        if c.path == "staging":  # whole remote blocks: a prefill rank's heads, every slot of 7 blocks
            assert c.bytes == 7 * block and c.granularity == "BLOCK" and c.num_descs == 7 * c.num_sources
        else:  # 7 segments of 16 tokens of one head, per layer and half, per source (in 1 or 16 pieces)
            assert c.bytes == 7 * 16 * 4 * 2 * 1 * 64 * 2 * c.num_sources and c.granularity == "CHUNK"
            assert c.num_descs == 7 * 4 * 2 * (1 if c.token_layouts == "HND:HND" else 16) * c.num_sources
    assert next(c for c in report.cases if c.tp == "1:2" and c.path == "staging").bytes == 7 * block  # 2x useful


def test_block_size_conversion_with_forced_paths(tmp_path) -> None:
    opts = BenchOptions(
        geometry=msgspec.structs.replace(SMALL, decode_block_size=64),
        tokens=[100],
        layout_pairs=[("kv_first", "blocks_first")],
        patterns=["runs:4"],
        reps=2,
        warmup=0,
        hetero_paths=["auto", "direct", "staging"],
        progress=False,
    )
    report = bench.run_bench(opts)
    assert [(c.hetero_path, c.path) for c in report.cases] == [("auto", "direct"), ("staging", "staging")]
    for c in report.cases:
        assert c.blocks == "16:64" and c.useful_bytes == 100 * 4 * 2 * 2 * 64 * 2
        assert c.verified_pulls == 3 and c.verified_bytes == 3 * c.useful_bytes and c.num_sources == 1
    direct, staged = report.cases
    assert direct.scatter_ms_median == 0 < staged.scatter_ms_median and staged.bytes == 7 * 32 * 1024


def test_every_prefill_rank_lease_ends_after_each_pull() -> None:
    """One KV head. 1:2 - both decode ranks read the prefill rank, so after decode rank 0's read its lease waits
    for decode rank 1: the bench releases it. 2:1 - both prefill ranks hold the head: rank 0 is read (completed),
    rank 1's copy is read by nobody (released). Afterwards no rank leases a block."""
    one_head = msgspec.structs.replace(SMALL, num_kv_heads=1)
    opts = BenchOptions(
        geometry=one_head,
        tokens=[64],
        layout_pairs=[("blocks_first", "cross_layer")],
        patterns=["scattered"],
        reps=1,
        warmup=0,
        tp_pairs=[(1, 2), (2, 1)],
    )
    config = ConnectorConfig(engine_id="bench-decode", side_channel_host="127.0.0.1", staging_mb=1)
    group = PrefillGroup(bench.transport_env(), "cpu", msgspec.structs.replace(config, engine_id="bench-prefill"))
    ends = []
    try:
        for index, key in enumerate(plan_cases(opts)):
            case = measure_case(group, opts, index, key, config, lambda: None)
            assert case.verified_pulls == 2 and case.verified_bytes == 2 * case.useful_bytes
            assert (case.num_sources, case.prefill_ranks) == (1, key.tp[0])
            last = f"bench-{index}-{case.verified_pulls}"
            ranks = sorted(case_shape(one_head, key, opts.cache_factor).prefill)
            ends.append({rank: peer.release(last) for rank, peer in zip(ranks, group.peers, strict=False)})
        assert ends == [{0: ("released", 0)}, {0: ("completed", 0), 1: ("released", 0)}]
        peer = group.peers[0]  # `release` ends a held lease and says what the rank still leases
        peer.lease("probe", [1, 2])
        assert peer.release("nothing") == ("unknown", 2) and peer.release("probe") == ("released", 0)
    finally:
        group.stop()
