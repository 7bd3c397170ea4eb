"""Reading released Medusa head files: `medusa_lm_head.safetensors`, or `medusa_lm_head.pt` (a state dict, loaded
only with `torch.load(weights_only=True)`, so a pickle payload is refused), plus an optional `config.json`.

The tensors are trusted over the config: released Vicuna configs say 2 heads while the files hold 5
(FasterDecoding/Medusa).
"""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from nextn.build.weight_checks import num_nonfinite


class MedusaHeadsError(ValueError):
    """A Medusa head file that cannot be used (missing, unsafe, malformed, or not fitting the base model)."""


@dataclass(frozen=True)
class MedusaHeadsCheckpoint:
    """Heads read from a directory or file: `tensors` keyed `{i}.{l}.linear.weight` etc., and their sizes."""

    tensors: dict[str, torch.Tensor]
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    source: Path


_NAME = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise MedusaHeadsError(f"{path} is not a readable safetensors file: {e}") from e
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise MedusaHeadsError(f"{path} carries a pickle payload beyond plain tensors and is refused "
                               f"(loaded with weights_only=True): {str(e).splitlines()[0]}; convert it to "
                               "medusa_lm_head.safetensors from a trusted environment") from e
    except Exception as e:
        raise MedusaHeadsError(f"{path} is not a readable PyTorch state dict: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise MedusaHeadsError(f"{path} does not hold a state dict of tensors")
    return state


def read_medusa_heads(path: str | Path) -> MedusaHeadsCheckpoint:
    """Read heads from a directory (medusa_lm_head.safetensors, else medusa_lm_head.pt) or a file.

    Raises:
        MedusaHeadsError: no head file, an unsafe or unreadable file, unexpected tensor names, or inconsistent
            shapes; the message names the file or tensor.
    """
    p = Path(path)
    if p.is_dir():
        candidates = [p / "medusa_lm_head.safetensors", p / "medusa_lm_head.pt"]
        found = [c for c in candidates if c.is_file()]
        if not found:
            raise MedusaHeadsError(f"{p} holds neither medusa_lm_head.safetensors nor medusa_lm_head.pt")
        p = found[0]
    elif not p.is_file():
        raise MedusaHeadsError(f"Medusa heads {p} do not exist")
    tensors = {k.removeprefix("medusa_head."): v for k, v in _load_tensors(p).items()}
    bad = [k for k in tensors if not _NAME.match(k)]
    if bad:
        raise MedusaHeadsError(f"{p}: unexpected tensor names {bad[:3]} (expected '{{i}}.{{l}}.linear.weight', "
                               "'{i}.{l}.linear.bias', '{i}.{L}.weight')")
    heads = sorted({int(_NAME.match(k)[1]) for k in tensors})
    if heads != list(range(len(heads))) or not heads:
        raise MedusaHeadsError(f"{p}: head indices {heads} are not 0..N-1")
    for name, t in tensors.items():
        if not t.is_floating_point():
            raise MedusaHeadsError(f"{p}: tensor {name!r} has dtype {t.dtype}; Medusa heads are floating point")
        bad_values = num_nonfinite(t)
        if bad_values:
            raise MedusaHeadsError(f"{p}: tensor {name!r} holds {bad_values} NaN/Inf value(s); the heads are "
                                   "corrupt or diverged, retrain or re-download them")
    proj = [k for k in tensors if k.endswith(".weight") and not k.endswith("linear.weight")]
    if not proj or tensors[proj[0]].dim() != 2:
        raise MedusaHeadsError(f"{p}: no 2-D output projection '{{i}}.{{L}}.weight' [vocab, hidden] found")
    num_layers = int(_NAME.match(proj[0])[2])
    vocab, hidden = tensors[proj[0]].shape
    for i in heads:
        for l in range(num_layers):
            for name, shape in ((f"{i}.{l}.linear.weight", (hidden, hidden)), (f"{i}.{l}.linear.bias", (hidden,))):
                if name not in tensors or tuple(tensors[name].shape) != shape:
                    got = list(tensors[name].shape) if name in tensors else "missing"
                    raise MedusaHeadsError(f"{p}: tensor {name!r} is {got}, expected {list(shape)}")
        name = f"{i}.{num_layers}.weight"
        if name not in tensors or tuple(tensors[name].shape) != (vocab, hidden):
            raise MedusaHeadsError(f"{p}: tensor {name!r} is missing or not [{vocab}, {hidden}]")
    config = p.parent / "config.json"
    if config.is_file():
        try:
            declared = json.loads(config.read_text()).get("medusa_num_heads")
        except (ValueError, AttributeError, OSError):  # not JSON / not an object: the tensors decide anyway
            declared = None
        if declared is not None and declared != len(heads):
            import logging

            logging.getLogger(__name__).warning("%s says medusa_num_heads=%s but %s holds %d heads: using the tensors",
                                                config, declared, p.name, len(heads))
    return MedusaHeadsCheckpoint(tensors, len(heads), num_layers, hidden, vocab, p)


def check_fits(heads: MedusaHeadsCheckpoint, hidden_size: int, vocab_size: int) -> None:
    """Raises MedusaHeadsError when the heads' hidden size or vocabulary differ from the base model's."""
    if (heads.hidden_size, heads.vocab_size) != (hidden_size, vocab_size):
        raise MedusaHeadsError(f"Medusa heads {heads.source} are for hidden size {heads.hidden_size} and vocabulary "
                               f"{heads.vocab_size}, but the base model has {hidden_size} and {vocab_size}")
