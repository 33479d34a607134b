"""`KVConnectConnector`: kvconnect behind vLLM's KV-connector interface (`KVConnectorBase_V1`).

Loaded by name: `--kv-transfer-config '{"kv_connector": "KVConnectConnector", "kv_connector_module_path":
"kvconnect.vllm", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_connector_extra_config":
{...}}'` (keys: `settings.py`). vLLM builds one instance in the scheduler process and one per worker;
each delegates to its half (`scheduler.py`, `worker.py`). Hooks left at the base class's no-op, and why:

- `start_load_kv`, `wait_for_layer_load`: loads are asynchronous; a request waits in vLLM's
  WAITING_FOR_REMOTE_KVS until its pull is usable, so no layer ever waits on one. Pulls start in
  `bind_connector_metadata`, before the step's forward, rather than after it.
- `save_kv_layer`, `wait_for_save`: nothing is pushed. The prefill's KV stays in vLLM's paged cache,
  leased, and the decode reads it with one NIXL READ.
- HMA (`SupportsHMA`): claimed where vLLM defines it (`compat.py`), so a hybrid model (sliding-window +
  full attention, or Mamba / linear-attention state + attention) keeps its KV cache groups:
  `request_finished_all_groups` leases each group's blocks (`groups.py`: a sliding window's tail only, a
  state group's state block only). A group of a kind the plug-in cannot move stops start-up.
- `on_new_request`: the prefill of a model with state computes all but the prompt's last token (`groups.py`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base as vllm_base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvconnect.core.config import env_choice
from kvconnect.core.errors import LayoutError
from kvconnect.vllm.compat import check_version, detect
from kvconnect.vllm.groups import group_moves, state_layers, state_spec
from kvconnect.vllm.layout import cross_layer_views
from kvconnect.vllm.metadata import StepOrders
from kvconnect.vllm.scheduler import KVConnectScheduler
from kvconnect.vllm.settings import data_parallel_index, rank_config, read_settings, required_layout
from kvconnect.vllm.stats import KVConnectPromMetrics, KVConnectStats
from kvconnect.vllm.worker import KVConnectWorker

if TYPE_CHECKING:  # vLLM's own types, for readers and mypy (never imported at run time: they move between releases)
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

API = detect(vllm_base)  # what this vLLM's connector interface offers (compat.py)
_HMA: tuple[type, ...] = (vllm_base.SupportsHMA,) if API.hma else ()  # (claimed where vLLM defines it)


SUPPORTED_FAMILIES = (
    "kvconnect moves dense and GQA attention (Llama, Qwen, Mistral), sliding-window + full attention hybrids "
    "(gpt-oss, Gemma 3), Mamba / linear-attention hybrids with equal TP sizes (Nemotron-H, Qwen3-Next) and MLA "
    "latent caches (DeepSeek, Kimi, GLM)"
)


def family_refusal(error: LayoutError, model: Any, latent: bool) -> LayoutError:
    """`error` (a cache the plug-in cannot describe) naming the model's architecture and what is supported."""
    family = ", ".join(getattr(getattr(model, "hf_config", None), "architectures", None) or ["?"])
    kind = "MLA latent" if latent else "attention"
    return LayoutError(f"{family} ({kind} KV cache): {error}. {SUPPORTED_FAMILIES}")


def _page_format(vllm_config: VllmConfig, dtype: torch.dtype, head_size: int, latent: bool) -> str:
    """Names what one page holds inside, so that only peers with the same format exchange pages (the CPU
    attention backend lays a page out per instruction set; every MLA backend keeps a token's latent as one
    vector, a different size where it differs, e.g. DeepSeek-V3.2's fp8_ds_mla)."""
    device = vllm_config.device_config.device_type
    if latent:
        return f"vllm:{device}-mla"
    if device != "cpu":
        return f"vllm:{device}"
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(dtype, vllm_config.cache_config.block_size, head_size)
    except Exception as e:  # a vLLM without it: still safe, only two "unknown" peers then pair
        log.warning("kvconnect: cannot tell the CPU attention page format (%s)", e)
        isa = "unknown"
    return f"vllm:cpu-{isa}"


def _log_to_stderr() -> None:
    """vLLM configures only its own loggers: give kvconnect's a handler of its own (once per process), at
    KVCONNECT_LOG_LEVEL (default INFO), unless the host application already did."""
    root = logging.getLogger("kvconnect")
    if root.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(
        logging.Formatter("(kvconnect pid=%(process)d) %(levelname)s %(asctime)s [%(name)s] %(message)s")
    )
    root.addHandler(handler)
    root.setLevel(env_choice("LOG_LEVEL", ("DEBUG", "INFO", "WARNING", "ERROR"), "INFO"))
    root.propagate = False


class KVConnectConnector(KVConnectorBase_V1, *_HMA):  # type: ignore[misc]  # (bases chosen at import)
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        check_version(getattr(vllm, "__version__", ""))
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]  # (None: an older caller)
        _log_to_stderr()
        self._settings = read_settings(vllm_config)
        moves = group_moves(kv_cache_config)  # (ConfigError: a KV cache group the plug-in cannot move)
        self._scheduler: KVConnectScheduler | None = None
        self._worker: KVConnectWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = KVConnectScheduler(self._settings, moves)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
            model = vllm_config.model_config
            self._worker = KVConnectWorker(
                rank_config(self._settings, rank, data_parallel_index(vllm_config.parallel_config)),
                rank,
                model.get_total_num_kv_heads(),  # (an MLA model's latent counts as one: layout.describe)
                failed_requests=API.transfer_results,
                state_groups=tuple(i for i, m in enumerate(moves) if m.state),
            )
            self._model = model
            self._latent = bool(getattr(model, "use_mla", False))  # MLA: latent caches, one vector per token

    # --- worker side -------------------------------------------------------------------------------

    def _worker_part(self) -> KVConnectWorker:
        assert self._worker is not None, "a worker hook was called on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        latent = self._latent
        states, held = state_layers(self._kv_cache_config)
        first = next(t for name, t in kv_caches.items() if name not in states)
        page = _page_format(self._vllm_config, first.dtype, self._model.get_head_size(), latent) + held
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else first.shape[0]
        try:
            self._worker_part().register_kv_caches(
                kv_caches,
                num_blocks,
                self._settings.block_size,
                self._settings.tp_size,
                page,
                latent,
                states,
                state_spec(self._kv_cache_config, self._model.hf_config, self._settings.tp_size) if states else None,
            )
        except LayoutError as e:
            raise family_refusal(e, self._model, latent) from e

    if API.cross_layer_blocks:  # vLLM 0.26: one tensor for every layer, when asked for (settings.py)

        @property
        def prefer_cross_layer_blocks(self) -> bool:
            return self._settings.cross_layer_blocks

        def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any) -> None:
            self.register_kv_caches(cross_layer_views(kv_cache, attn_backend))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, StepOrders):
            self._worker_part().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker_part().transfer_results(finished_req_ids)
        return sending or None, recving or None

    if API.transfer_results:  # vLLM 0.32+: sends, receives and failed receives in one report

        def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
            sending, recving, failed = self._worker_part().transfer_results(finished_req_ids)
            return vllm_base.KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_part().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVConnectStats | None:
        return self._worker.stats() if self._worker is not None else None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker_part().get_handshake_metadata()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # --- scheduler side ----------------------------------------------------------------------------

    def _scheduler_part(self) -> KVConnectScheduler:
        assert self._scheduler is not None, "a scheduler hook was called on a worker's connector"
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self._scheduler_part().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_part().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler_part().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_part().build_connector_meta(
            int(getattr(scheduler_output, "total_num_scheduled_tokens", 1))
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_part().request_finished(request, (block_ids,))

    if API.hma:  # one block list per KV cache group (groups.py)

        def request_finished_all_groups(
            self, request: Request, block_ids: tuple[list[int], ...]
        ) -> tuple[bool, dict[str, Any] | None]:
            return self._scheduler_part().request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[Any, KVConnectorHandshakeMetadata]) -> None:
        self._scheduler_part().set_xfer_handshake_metadata(metadata)

    # --- any process -------------------------------------------------------------------------------

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Heads outermost in a page ("HND", vLLM 0.32's LBHNC) unless the extra config says `kv_cache_layout:
        "vllm"`: then a prefill and a decode of different TP sizes can exchange runs of whole heads (one
        descriptor per block and layer), as NixlConnector asks too. MLA caches have no heads: vLLM's choice."""
        model = getattr(vllm_config, "model_config", None)
        if model is None or getattr(model, "use_mla", False):
            return None
        return required_layout(vllm_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectStats | None:
        return KVConnectStats(data=dict(data)) if data is not None else KVConnectStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
    ) -> KVConnectPromMetrics:
        return KVConnectPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
