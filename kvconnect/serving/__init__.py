"""The application: OpenAI-compatible workers (demo engine + connector), the llm-d style proxy, metrics,
fault injection and the local demo."""
