"""`SamplingParams`, in the shape of TensorRT-LLM's and vLLM's, validated at the edge."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names it and the valid range."""


class SamplingParams(BaseModel):
    """How to decode one request.

    Attributes:
        max_tokens: tokens to generate at most (≥ 1).
        temperature: 0 = greedy (argmax); > 0 samples from softmax(logits / temperature). With speculative
            decoding, drafts are then accepted by rejection sampling, which keeps the target's distribution exactly.
        top_k: keep the k most likely tokens (0 = off).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 = off).
        seed: the request's random seed; same seed → same output whatever else is in the batch. None: drawn
            at submission.
        end_id: the end-of-sequence token; None = the engine's EOS.
        stop_token_ids: more tokens that end the request (emitted, then stop).
        ignore_eos: keep going past EOS (benchmarks: exactly `max_tokens` tokens).
        detokenize: fill `.text` when the engine has a tokenizer.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    detokenize: bool = True

    def __init__(self, **kwargs) -> None:
        try:
            super().__init__(**kwargs)
        except ValidationError as e:
            msgs = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'SamplingParams'}: {err['msg']}" for err in e.errors())
            raise SamplingParamsError(f"invalid SamplingParams: {msgs}") from None

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"max_tokens must be ≥ 1, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if not v >= 0 or v == float("inf"):
            raise ValueError(f"temperature must be ≥ 0 and finite (0 = greedy), got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = off), got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not 0 <= v < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {v}")
        return v
