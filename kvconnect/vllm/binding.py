"""What binds a lease to a vLLM request: everything vLLM's prefix cache keys the request's KV by.

vLLM's block hashes cover the token ids and, per block, the extra keys its KV depends on: the request's cache salt,
each multimodal item's identity and place, the LoRA adapter (name and path), and the prompt embeddings of a prompt
given as embeddings. A binding that left any of these out would let a decode load (and cache, under its own block
hashes) the KV of image A for image B, of one adapter for another, or of an attacker's embeddings for another
tenant's prompt. `prompt_binding` digests all of them (`params.prompt_digest`), on the prefill when it leases and on
the decode when it pulls; where it cannot (an item without an identity, a prompt of neither tokens nor
embeddings) it returns b"" and the request is not leased, nor pulled for.
"""

from __future__ import annotations

from typing import Any

from kvconnect.core.plan.params import prompt_digest


def prompt_binding(request: Any, backoff: int = 0) -> bytes:
    """The binding of the request's prompt less its last `backoff` tokens (which the decode computes itself: a
    model with state), or b"" when it cannot be computed."""
    token_ids = getattr(request, "prompt_token_ids", None)
    embeds = getattr(request, "prompt_embeds", None)
    if token_ids is None and embeds is None:
        return b""
    num_tokens = int(getattr(request, "num_prompt_tokens", 0) or (len(token_ids) if token_ids is not None else 0))
    num_tokens -= backoff
    if num_tokens <= 0:
        return b""
    extras: list[tuple[str, bytes]] = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts = (getattr(lora, "lora_name", ""), getattr(lora, "lora_path", "") or "", getattr(lora, "lora_int_id", 0))
        extras.append(("lora", "\0".join(str(x) for x in parts).encode()))
    for feature in getattr(request, "mm_features", None) or []:
        place = feature.mm_position
        if int(place.offset) >= num_tokens:
            continue  # (past the tokens the lease covers)
        if not getattr(feature, "identifier", None):
            return b""
        extras.append(("mm", f"{feature.identifier}\0{int(place.offset)}\0{int(place.length)}".encode()))
    if embeds is not None:
        import torch

        part = embeds[:num_tokens].contiguous()
        extras.append(("embeds-shape", f"{part.dtype}\0{tuple(part.shape)}".encode()))
        extras.append(("embeds", part.view(torch.uint8).cpu().numpy().tobytes()))
    tokens = token_ids[:num_tokens] if token_ids is not None else []
    return prompt_digest(tokens, getattr(request, "cache_salt", None), extras)
