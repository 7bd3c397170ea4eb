"""Test support: fuzzers, batch-invariance and speculative-decoding checks; re-exports the tiny DeepSeek-V3-format
checkpoints and the self-distillation of their MTP modules (product code in `nextn.train`, used by `nextn demo`)."""

from nextn.train.mtp_distill import distill_mtp
from nextn.train.tiny_checkpoint import SMALL_VOCAB, TinyDeepseekSpec, YarnRope, make_tiny_checkpoint

__all__ = ["SMALL_VOCAB", "TinyDeepseekSpec", "YarnRope", "distill_mtp", "make_tiny_checkpoint"]
