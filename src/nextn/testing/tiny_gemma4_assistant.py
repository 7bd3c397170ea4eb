"""A tiny random Gemma 4 assistant drafter (`Gemma4AssistantForCausalLM`) for the tiny Gemma 4 target of
`tiny_families.GEMMA4`, made by `transformers` at test time, and `transformers`' drafts as the reference.

`transformers` 5.23 cannot build an assistant as its config describes it: `Gemma4TextConfig.kv_sharing_modes` refuses
a model whose every layer reads shared KV (it looks for a layer of each type that stores KV) — the very shape
`Gemma4AssistantConfig` requires. `assistant_modes` gives such a config HF's own mode for a shared layer ("reuse") on
every layer while the model is built; nothing else of HF's modelling changes.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import torch

from nextn.testing.tiny_families import _BASE, _draw

#: Two assistant layers (one sliding, one full) with the target's head shapes (sliding: 1 KV head of 16; full: 1 KV
#: head of 32 with k_eq_v), hidden 32 against the target's 64, the target's window of 16.
ASSISTANT_TEXT: dict[str, Any] = dict(
    _BASE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16,
    layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0, num_kv_shared_layers=2)


@contextlib.contextmanager
def assistant_modes() -> Iterator[None]:
    """While open, a Gemma 4 text config whose every layer is KV-shared builds as one ("reuse" on every layer)."""
    from transformers import Gemma4TextConfig

    modes = Gemma4TextConfig.kv_sharing_modes

    def patched(self):
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return modes.fget(self)

    with mock.patch.object(Gemma4TextConfig, "kv_sharing_modes", property(patched)):
        yield


def tiny_assistant(seed: int = 1, ordered: bool = True, backbone_hidden_size: int = 64, **text: Any):
    """A float32 `Gemma4AssistantForCausalLM` in eval mode (`text`: changes to `ASSISTANT_TEXT`), weights drawn as
    `tiny_families.tiny_hf_model`'s; with `ordered`, the centroid-masked head (64 clusters of 768 tokens, top 4) over
    a random token ordering."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    cfg = Gemma4AssistantConfig(text_config={**ASSISTANT_TEXT, **text}, backbone_hidden_size=backbone_hidden_size,
                                use_ordered_embeddings=ordered, num_centroids=64, centroid_intermediate_top_k=4)
    torch.manual_seed(seed)
    with assistant_modes():
        model = Gemma4AssistantForCausalLM(cfg).eval()
    _draw(model, 1.0)
    if ordered:
        model.masked_embedding.token_ordering.copy_(torch.randperm(cfg.text_config.vocab_size))
    return model


def save_tiny_assistant(out_dir: Path, tokenizer_dir: Path | None = None, seed: int = 1, ordered: bool = True,
                        **text: Any):
    """`tiny_assistant` saved as an HF checkpoint in `out_dir` (with the tokenizer files of `tokenizer_dir`, as
    the released assistants ship them); returns the model."""
    model = tiny_assistant(seed, ordered, **text)
    model.save_pretrained(out_dir)
    for f in (tokenizer_dir.iterdir() if tokenizer_dir else ()):
        shutil.copy(f, out_dir / f.name)
    return model


@torch.no_grad()
def reference_drafts(target, assistant, context: list[int], k: int) -> list[int]:
    """`transformers`' K drafts for a request whose tokens so far are `context` (its last token not yet run by the
    target): the target runs context[:-1] and returns its KV of each stored layer type and its last hidden state,
    then `SinglePositionMultiTokenCandidateGenerator`'s loop — [embedding(last token); hidden] at position
    len(context) − 1, K times. The sliding KV is cut to the window's last `sliding_window − 1` keys, the keys a
    target query at that position would see besides its own (the engine's and llama.cpp's mask; HF's
    bidirectional mask over a full cache keeps up to two more)."""
    ids = torch.tensor([context[:-1]])
    out = target(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
    shared = dict(out.shared_kv_states)
    keep = assistant.config.text_config.sliding_window - 1
    shared["sliding_attention"] = tuple(t[:, :, -keep:] for t in shared["sliding_attention"])
    hidden = out.hidden_states[-1][:, -1:]
    token = torch.tensor([[context[-1]]])
    position = torch.tensor([[len(context) - 1]])
    drafts = []
    for _ in range(k):
        step = assistant(inputs_embeds=torch.cat([target.get_input_embeddings()(token), hidden], dim=-1),
                         position_ids=position, shared_kv_states=shared)
        token, hidden = step.logits.argmax(-1), step.last_hidden_state
        drafts.append(int(token))
    return drafts
