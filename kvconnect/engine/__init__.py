"""The demo engine: a tiny seeded Llama-architecture model serving from kvconnect's paged KV cache.

It owns the model, the cache, the block allocator, the byte tokenizer and a scheduler thread, and it
exposes the two prefill/decode hooks (`KVKeeper`, `KVLoader`) the connector plugs into. It never
imports nixl, zmq or HTTP libraries. Module map: config, tokenizer, allocator, attention, model,
sampling, hooks, sequence, scheduler, engine.
"""

from kvconnect.engine.allocator import BlockAllocationError, BlockAllocator, OutOfBlocksError
from kvconnect.engine.config import EngineConfig, ModelConfig
from kvconnect.engine.engine import Engine, EngineStateError
from kvconnect.engine.hooks import KVKeeper, KVLoader, KVLoadHandle
from kvconnect.engine.sampling import SamplingParams
from kvconnect.engine.sequence import FinishReason, TokenEvent
from kvconnect.engine.tokenizer import BOS_ID, EOS_ID, ByteTokenizer, ChatMessage, IncrementalDecoder

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "BlockAllocationError",
    "BlockAllocator",
    "ByteTokenizer",
    "ChatMessage",
    "Engine",
    "EngineConfig",
    "EngineStateError",
    "FinishReason",
    "IncrementalDecoder",
    "KVKeeper",
    "KVLoadHandle",
    "KVLoader",
    "ModelConfig",
    "OutOfBlocksError",
    "SamplingParams",
    "TokenEvent",
]
