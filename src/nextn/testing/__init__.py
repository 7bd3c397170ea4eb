"""Test fixtures: tiny DeepSeek-V3-format checkpoints and a quick self-distillation of their MTP modules."""

from nextn.testing.mtp_distill import distill_mtp
from nextn.testing.tiny_checkpoint import SMALL_VOCAB, TinyDeepseekSpec, YarnRope, make_tiny_checkpoint

__all__ = ["SMALL_VOCAB", "TinyDeepseekSpec", "YarnRope", "distill_mtp", "make_tiny_checkpoint"]
