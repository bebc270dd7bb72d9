"""A vLLM-compatible engine emulator: OpenAI API, paged KV cache, KV events, NIXL transfers."""
