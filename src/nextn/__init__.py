"""nextn: engines with a fused verify-and-draft step for self-drafting LLM checkpoints (DeepSeek MTP, Medusa)."""

__version__ = "0.1.0"
