"""The runtime: LLM API, engine loop, scheduler, KV cache, model runner, the verify-and-draft step, drafters."""
