"""What a checkpoint's stored tensor names say about its model, checked against the config before a build starts.

A config or GGUF header states counts (layers, MTP modules) that the build multiplies into tensor lists, loops and
allocations; the stored tensors are the ground truth. Two checks, each in time and memory bounded by the number of
stored tensors, never by a count the file states:
- `check_layer_counts`: every main layer the config declares is stored (a GGUF `block_count` of 2**32 - 1 over 5
  stored blocks is refused before any list of 2**32 names exists), and declared MTP layers are stored when any is;
- `check_all_read`: every stored tensor is one the engine reads, or one its layout drops by design
  (`unread_tensors` of `models/*/weights.py`: MTP layers' copies of the embedding and lm_head, a tied model's lm_head
  copy, RoPE `inv_freq` buffers). A config of 3 layers over weights of 5, or a stray `blk.999999999.attn_q.weight`,
  is named instead of building a model that decodes garbage; `allow_unused` (`build-engine --allow_unused_tensors`)
  builds without them, with a warning.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

from nextn.models.config import ConfigError
from nextn.models.deepseek_v3.weights import WeightError

# `model.language_model.layers.N.`: the text model of a vision-language checkpoint (Qwen3.5 releases)
_LAYER_RE = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.")
#: How many names or index ranges a message lists before "…".
SHOWN = 6
logger = logging.getLogger(__name__)


def layer_index(name: str) -> int | None:
    """The decoder-layer index of an HF tensor name (`model.layers.12.mlp...` → 12), else None."""
    m = _LAYER_RE.match(name)
    return int(m[1]) if m else None


def stored_layers(names: Iterable[str]) -> set[int]:
    """The layer indices that have at least one stored tensor."""
    return {i for i in map(layer_index, names) if i is not None}


def spans(indices: Iterable[int]) -> str:
    """Sorted indices as ranges, at most SHOWN of them: [0, 1, 2, 5, 999999999] → "0-2, 5, 999999999"."""
    out: list[list[int]] = []
    for i in sorted(set(indices)):
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    text = [f"{a}-{b}" if a != b else str(a) for a, b in out[:SHOWN]]
    return ", ".join(text) + (", …" if len(out) > SHOWN else "")


def check_layer_counts(num_layers: int, num_mtp_layers: int, names: Iterable[str], field: str) -> None:
    """Refuse a layer count the stored tensors do not back.

    Args:
        num_layers: the config's main decoder layers (`num_hidden_layers`, a GGUF's `{arch}.block_count`).
        num_mtp_layers: its MTP modules (`num_nextn_predict_layers`), stored as layers num_layers, num_layers + 1, ….
            None stored is left to `engine_settings.check_mtp_layers` (transformers' `save_pretrained` writes the
            count without the tensors); some stored means all must be.
        names: every stored tensor name (HF names).
        field: where the count comes from, for the message (e.g. "config.json num_hidden_layers").
    Raises:
        ConfigError: a main layer below `num_layers`, or an MTP layer below `num_layers + num_mtp_layers` when any
            is stored, has no tensors; the message names the field and the layers stored.
    """
    layers = stored_layers(names)
    stored = f"the checkpoint stores layers {spans(layers)}" if layers else "the checkpoint stores no layers"
    if num_layers > len(layers):  # decided before any range(num_layers) exists
        raise ConfigError(f"{field} is {num_layers} but {stored} ({len(layers)} in all): the count does not match "
                          "the weights; fix it")
    missing = [i for i in range(num_layers) if i not in layers]
    if missing:
        raise ConfigError(f"{field} is {num_layers} but layer(s) {spans(missing)} have no tensors ({stored}): the "
                          "count does not match the weights; fix it")
    mtp = [i for i in layers if num_layers <= i < num_layers + num_mtp_layers]
    if mtp and len(mtp) < num_mtp_layers:
        raise ConfigError(f"num_nextn_predict_layers is {num_mtp_layers} but {stored}: MTP layer(s) "
                          f"{spans(set(range(num_layers, num_layers + num_mtp_layers)) - set(mtp))} after the "
                          f"{num_layers} main ones have no tensors; fix num_nextn_predict_layers")


def check_all_read(unread: list[str], num_layers: int, num_mtp_layers: int, allow_unused: bool = False) -> None:
    """Refuse a build that would leave stored tensors out of the engine, or warn when `allow_unused`.

    Args:
        unread: stored tensors the engine's layout does not read (`unread_tensors` of the model's weights module).
        num_layers, num_mtp_layers: the config's counts (to explain layers stored beyond them).
    Raises:
        WeightError: `unread` is not empty and `allow_unused` is false; the message counts and names them, the layers
            beyond the config's counts, and the fix.
    """
    if not unread:
        return
    beyond = {i for i in map(layer_index, unread) if i is not None and i >= num_layers + num_mtp_layers}
    why = (f" (layer(s) {spans(beyond)} lie beyond num_hidden_layers={num_layers} + "
           f"num_nextn_predict_layers={num_mtp_layers}; GGUF: block_count)" if beyond else "")
    shown = ", ".join(repr(n) for n in unread[:SHOWN]) + (", …" if len(unread) > SHOWN else "")
    message = f"the checkpoint stores {len(unread)} tensor(s) the engine would not read{why}: {shown}"
    if allow_unused:
        logger.warning("%s; building without them (--allow_unused_tensors)", message)
        return
    raise WeightError(f"{message}. The config does not describe these weights (a wrong layer count, or tensors of "
                      "another model): fix the config, or pass --allow_unused_tensors (build_engine("
                      "allow_unused_tensors=True)) to build without them, e.g. MTP layers you do not want")
