"""The HF checkpoint `nextn train-draft --method mtp` writes: the base's tensors as `build-engine` reads them, plus the
trained modules as MTP layers `model.layers.{num_hidden_layers + k}` and their config keys."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file


def _base_tensors(model_dir: Path) -> tuple[dict, dict[str, torch.Tensor], Callable[[Path], None]]:
    """(config.json dict, HF-named tensors, a function writing the tokenizer files) of a GGUF or HF Llama base."""
    from nextn.build.engine_builder import AUX_FILES, TOKENIZER_FILES, open_checkpoint
    from nextn.build.gguf_reader import GGUFCheckpoint

    with open_checkpoint(model_dir) as reader:
        tensors = {name: reader.get(name).contiguous() for name in reader.names()}
        if isinstance(reader, GGUFCheckpoint):
            config = dict(reader.hf_config)
            gguf = reader.path
            return config, tensors, lambda out: GGUFCheckpoint(gguf).write_tokenizer_files(out)
    config = json.loads((model_dir / "config.json").read_text())

    def copy_side_files(out: Path) -> None:
        for name in (*TOKENIZER_FILES, *AUX_FILES):
            if (model_dir / name).is_file():
                shutil.copy2(model_dir / name, out / name)

    return config, tensors, copy_side_files


def mtp_config(config: dict, num_modules: int, moe: bool) -> dict:
    """The base's config.json dict declaring `num_modules` trained MTP layers: `num_nextn_predict_layers` (Qwen3.5's
    family: `mtp_num_hidden_layers`), `mtp_chain_normed: false` (trained with each step reading the block output of
    the one before), `mtp_moe` for an MoE base's block (the engine builds the MTP layers' MLP as MoE)."""
    out = {**config, "num_nextn_predict_layers": num_modules, "mtp_chain_normed": False}
    if "mtp_num_hidden_layers" in config or str(config.get("model_type", "")).startswith(("qwen3_5", "qwen3_next")):
        out["mtp_num_hidden_layers"] = num_modules
    if moe:
        out["mtp_moe"] = True
    return out


def write_mtp_checkpoint(model_dir: str | Path, modules: list[dict[str, torch.Tensor]], output_dir: str | Path) -> Path:
    """An HF checkpoint of the base with `modules` as MTP layers `model.layers.{num_hidden_layers + k}`.

    Writes config.json (`num_nextn_predict_layers` = len(modules)), model.safetensors (the base's tensors as
    `build-engine` reads them — a GGUF's un-permuted — plus the modules) and the base's tokenizer files.
    Existing MTP layers of the base are replaced (Qwen3.5's `mtp.*` ones too).
    """
    config, tensors, write_tokenizer = _base_tensors(Path(model_dir))
    n = int(config["num_hidden_layers"])
    layer = re.compile(r"model\.layers\.(\d+)\.")
    state = {k: v for k, v in tensors.items()
             if not ((m := layer.match(k)) and int(m[1]) >= n) and not k.startswith("mtp.")}
    for k, module in enumerate(modules):
        state.update({f"model.layers.{n + k}.{name}": t for name, t in module.items()})
    config = mtp_config(config, len(modules), any(".experts." in name for module in modules for name in module))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(state.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer(out)
    return out
