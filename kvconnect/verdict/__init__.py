"""Transport verdict: how fast a NIXL READ runs on this host and memory kind, against a plain torch copy of
the same bytes in the same run, and which UCX transport carried it.

NIXL does not say which UCX transport it ended up on, but UCX does: with `UCX_PROTO_INFO=used` each UCX
worker prints, when it is destroyed, a table of the protocols it actually used, e.g.

    | ini intra-node cfg#1                                             |
    | remote memory read by ucp_get*(multi) into host memory from host |
    | Count | Range  | Description        | Config  |
    |     5 | 0..inf | software emulation | tcp/lo  |

The Config column names `transport/device` (`cma/memory`, `tcp/lo`, `cuda_ipc/cuda`, `rc_mlx5/mlx5_0:1`,
or `66% on cma/memory and 34% on rc_mlx5/mlx5_0:1` for several rails). So `calibrate()` runs the
measurement in a child process (`python -m kvconnect.verdict.probe`) with that variable set and UCX's log sent to
a file (`UCX_LOG_FILE`) in a scratch directory, then reads the READ's table from it; when there is none it
reports "unknown". The child spawns a second process that owns the scratch buffer, so the READ crosses
processes as a real pull does (two agents of one process are not what a pull sees: UCX refuses cuda_ipc
within one process, for one). Both processes inherit this process's environment (UCX_TLS and friends).

The verdict is a READ between two processes of *this* host on the worker's memory kind: it shows what
UCX makes of local transfers (shared memory, cuda_ipc, or a fall back to TCP), not the network path to a
prefill worker on another host.

The measurement is `kvconnect.verdict.probe` (not imported here: `python -m kvconnect.verdict.probe` would
then find itself imported twice); UCX's tables are parsed, and the verdict struct defined, in
`kvconnect.verdict.ucx_tables`.
"""
