"""vLLM's own NixlConnector, run the way a fair comparison on a small CPU box needs (head-to-head only).

Two things its CPU worker does that would measure the machine rather than the transfer, both undone:

- it pins the worker's main thread (which also runs the model) to the last core of each NUMA node, so a
  prefill and a decode server on one 2-core host end up on the same core, whatever
  `VLLM_CPU_OMP_THREADS_BIND` says: the affinity it had before is restored;
- its NIXL agent runs NIXL's progress thread, which polls without sleeping and costs about a core per
  process even when idle: it is created without one (kvconnect's agents have none either; both then
  drive progress from their own loops).

Load it as `{"kv_connector": "FairNixlConnector", "kv_connector_module_path": "kvconnect.bench.nixl_fair"}`.
Everything else is vLLM's NixlConnector as shipped.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector, base_worker

log = logging.getLogger(__name__)


class FairNixlConnector(NixlConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        shipped = base_worker.nixl_agent_config

        def without_progress_thread(*args: Any, **kwargs: Any) -> Any:
            kwargs["enable_prog_thread"] = False
            return shipped(*args, **kwargs)

        affinity = os.sched_getaffinity(0)
        base_worker.nixl_agent_config = without_progress_thread
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            base_worker.nixl_agent_config = shipped
        if os.sched_getaffinity(0) != affinity:
            log.warning(
                "FairNixlConnector: the NIXL worker pinned this thread to %s; restored %s",
                sorted(os.sched_getaffinity(0)),
                sorted(affinity),
            )
            os.sched_setaffinity(0, affinity)
