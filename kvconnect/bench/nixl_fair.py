"""vLLM's own NixlConnector, run the way a fair comparison on a small CPU box needs (head-to-head only).

Two things its CPU worker does that would measure the machine rather than the transfer, both undone:

- it pins the worker's main thread (which also runs the model) to the last core of each NUMA node, so a
  prefill and a decode server on one 2-core host end up on the same core, whatever
  `VLLM_CPU_OMP_THREADS_BIND` says: the affinity it had before is restored;
- its NIXL agent runs NIXL's progress thread, which polls without sleeping and costs about a core per
  process even when idle: it is created without one (kvconnect's agents have none either; both then
  drive progress from their own loops).

Load it as `{"kv_connector": "FairNixlConnector", "kv_connector_module_path": "kvconnect.bench.nixl_fair"}`
(`FairNixlPushConnector`: vLLM's NixlPushConnector, where the prefill WRITEs, undone the same way).
Everything else is vLLM's connector as shipped.

`ProgressNixlConnector` and `ProgressNixlPushConnector` undo the pinning only and keep the progress thread. A
prefill needs it wherever a READ is not one-sided: over UCX's TCP transport the prefill's worker must progress to
serve a READ, and once it holds nothing its engine stops stepping, so without the thread a decode's READ waits
for the prefill's next request (seen: 12 s and 110 s). Over cma (one host, UCX's defaults) the reader copies by
itself, as the head-to-head runs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, NixlPushConnector, base_worker

log = logging.getLogger(__name__)


def _fair_init(connector: Any, init: Any, *args: Any, progress_thread: bool = False) -> None:
    """Run a NIXL connector's `init` (without its progress thread unless `progress_thread`), then undo its
    thread pinning."""
    shipped = base_worker.nixl_agent_config

    def without_progress_thread(*a: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return shipped(*a, **kwargs)

    affinity = os.sched_getaffinity(0)
    if not progress_thread:
        base_worker.nixl_agent_config = without_progress_thread
    try:
        init(connector, *args)
    finally:
        base_worker.nixl_agent_config = shipped
    if os.sched_getaffinity(0) != affinity:
        log.warning(
            "%s: the NIXL worker pinned this thread to %s; restored %s",
            type(connector).__name__,
            sorted(os.sched_getaffinity(0)),
            sorted(affinity),
        )
        os.sched_setaffinity(0, affinity)


class FairNixlConnector(NixlConnector):
    progress_thread = False

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        _fair_init(
            self, NixlConnector.__init__, vllm_config, role, kv_cache_config, progress_thread=self.progress_thread
        )


class FairNixlPushConnector(NixlPushConnector):
    progress_thread = False

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        _fair_init(
            self, NixlPushConnector.__init__, vllm_config, role, kv_cache_config, progress_thread=self.progress_thread
        )


class ProgressNixlConnector(FairNixlConnector):
    progress_thread = True


class ProgressNixlPushConnector(FairNixlPushConnector):
    progress_thread = True
