"""Gemma 4's per-layer inputs (PLE): a second, per-layer embedding of every token mixed into each decoder layer's
output through a small gated projection.

Sources: HF `transformers` 5.23 `modeling_gemma4.py` (`Gemma4TextModel.get_per_layer_inputs`,
`project_per_layer_inputs`; the block at the end of `Gemma4TextDecoderLayer.forward`), the oracle; parameter names
are its (`model.embed_tokens_per_layer`, `model.per_layer_model_projection`, `model.per_layer_projection_norm`, and
per layer `per_layer_input_gate`, `per_layer_projection`, `post_per_layer_input_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from nextn.models.layers import ACTIVATIONS, RMSNorm, row_exact


def add_model_modules(body: nn.Module, vocab_size: int, hidden_size: int, num_layers: int, width: int,
                      norm: type[RMSNorm], eps: float) -> None:
    """Give the model body (`model.*`) the model-level modules under HF's names: `embed_tokens_per_layer`
    [vocab_size, num_layers · width], `per_layer_model_projection` (hidden → num_layers · width),
    `per_layer_projection_norm` [width] (the family's RMSNorm class `norm`, epsilon `eps`)."""
    body.embed_tokens_per_layer = nn.Embedding(vocab_size, num_layers * width)
    body.per_layer_model_projection = nn.Linear(hidden_size, num_layers * width, bias=False)
    body.per_layer_projection_norm = norm(width, eps=eps)


def model_inputs(body: nn.Module, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
    """Every layer's input: (norm(proj(embeds) · hidden^−½) + embed_per_layer(ids) · √width) · 2^−½.

    Args:
        body: a module given `add_model_modules`.
        input_ids: [B, T] int64; embeds: [B, T, hidden] (the main embedding's output, already × √hidden).
    Returns:
        [B, T, num_layers, width] in embeds' dtype.
    """
    table, proj = body.embed_tokens_per_layer, body.per_layer_model_projection
    width = body.per_layer_projection_norm.weight.shape[0]
    shape = (*input_ids.shape, table.weight.shape[1] // width, width)
    token = table(input_ids)
    token = (token * torch.tensor(width ** 0.5, dtype=token.dtype)).view(shape)
    mixed = body.per_layer_projection_norm((proj(embeds) * embeds.shape[-1] ** -0.5).view(shape))
    return (mixed + token) * (2.0 ** -0.5)


def add_layer_modules(layer: nn.Module, hidden_size: int, width: int, act: str, norm: type[RMSNorm],
                      eps: float) -> None:
    """Give a decoder layer the layer-level modules under HF's names: `per_layer_input_gate` (hidden → width),
    `per_layer_projection` (width → hidden), `post_per_layer_input_norm` [hidden]; `act` the gate's activation."""
    layer.per_layer_input_gate = nn.Linear(hidden_size, width, bias=False)
    layer.per_layer_projection = nn.Linear(width, hidden_size, bias=False)
    layer.post_per_layer_input_norm = norm(hidden_size, eps=eps)
    layer.per_layer_act = act


def layer_output(layer: nn.Module, x: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
    """x + norm(projection(act(gate(x)) · per_layer_input)), after the layer's MLP residual.

    Args:
        layer: a module given `add_layer_modules`; x: [B, T, hidden]; per_layer_input: [B, T, width].
    Returns:
        [B, T, hidden].
    """
    gate = layer.per_layer_input_gate(x)
    act = ACTIVATIONS[layer.per_layer_act]
    gate = row_exact(act, gate) if gate.device.type == "cpu" else act(gate)
    return x + layer.post_per_layer_input_norm(layer.per_layer_projection(gate * per_layer_input))
