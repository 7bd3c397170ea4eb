"""`SamplingParams`, in the shape of TensorRT-LLM's and vLLM's, validated at the edge."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; the message names it and the valid range."""


class SamplingParams(BaseModel):
    """How to decode one request.

    Attributes:
        max_tokens: tokens to generate at most (≥ 1).
        temperature: 0 = greedy (the only mode in this release; sampling arrives with rejection sampling).
        end_id: the end-of-sequence token; None = the engine's EOS.
        stop_token_ids: more tokens that end the request (emitted, then stop).
        ignore_eos: keep going past EOS (benchmarks: exactly `max_tokens` tokens).
        detokenize: fill `.text` when the engine has a tokenizer.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = 32
    temperature: float = 0.0
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
        if v < 0:
            raise ValueError(f"temperature must be ≥ 0, got {v}")
        if v > 0:
            raise ValueError("temperature > 0 (sampling) is not supported yet: use temperature=0 (greedy); "
                             "lossless rejection sampling is tracked as its own issue")
        return v
