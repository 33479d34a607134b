"""The local harness: kvconnect processes started and driven from one Python process. A prefill worker in
a process of its own (`prefill.py`), a local cluster of OpenAI workers and the proxy (`cluster.py`), vLLM
servers with the plug-in (`vllm_cluster.py`), tiny generated checkpoints (`tiny_llama.py`), vLLM-shaped
caches (`vllm_shapes.py`), free ports (`net.py`). The demo and the benchmarks run on it; so do the tests,
whose own helpers live under tests/."""
