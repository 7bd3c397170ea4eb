"""What every draft-head trainer shares: the settings, the prepared base and data, the time budget, and the record
written to `train_draft.json`.

A run = load the frozen base (`transformers`) → self-distillation data (`train/data.py`, cached) → train (the
method's own code over `train/loop.py`, resumable) → write the heads in their released format → record. Times are
kept per part (generation, hidden states, training; wall-clock and this process's CPU time) because the machine is
shared: CPU seconds are the better estimate of an idle machine.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from nextn.build.output_files import claim_output_dir
from nextn.config.user_files import read_user_json
from nextn.train.data import DataConfig, SelfDistillData, load_base, make_self_distill_data

#: The record a run writes into its output directory.
RECORD_NAME = "train_draft.json"


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings shared by the trainers."""

    steps: int = 2000  # optimizer steps
    batch: int = 64  # sequences per step
    lr: float = 1e-3  # Adam learning rate, decayed linearly to 0
    warmup: int = 0  # steps of linear warm-up before the decay
    bf16: bool = False  # the loss under CPU bfloat16 autocast (~2.5× faster steps where the CPU has bf16)
    seed: int = 0  # batches and initialisation (the data's split has its own, DataConfig.seed)
    max_minutes: float | None = None  # budget of the whole run (data included); training stops and can resume
    max_context: int | None = 64  # prompt tokens kept before the generated ones (SelfDistillData.with_context)
    loss_vocab: str = "data"  # "data": softmax over the tokens of the training data (LossVocab); "full"
    feature_weight: float = 0.0  # EAGLE's feature loss weight (MTP)
    init: str = "base"  # MTP: "base" (MtpModule.warm_start_from_base) or "random" (MtpModule.warm_start)
    train_on_prompts: bool = True  # prompt positions train too, on the base's own predictions (Rows.targets)
    eval_every: int = 100  # steps between held-out top-1 measurements in the progress bar
    checkpoint_every_s: float = 120.0  # seconds between resumable checkpoints
    tree_nodes: int = 15  # MTP Eagle: draft nodes of the static tree calibrated after training (train_draft.json)
    tree_depth: int = 0  # MTP Eagle: the deepest draft step that tree may use (0: twice the trained draft steps)
    progress: bool = True

    def run_key(self, data_key: str, **extra: object) -> str:
        """What a resumable checkpoint must match: the data and every setting that shapes the run."""
        own = {k: v for k, v in asdict(self).items() if k not in ("max_minutes", "progress", "checkpoint_every_s",
                                                                    "eval_every", "tree_nodes", "tree_depth")}
        return json.dumps({"data": data_key, **own, **extra}, sort_keys=True)


def is_train_output(out: Path) -> bool:
    """An output written before output markers existed: its train_draft.json is a trainer's record."""
    try:
        meta = read_user_json(out / RECORD_NAME, RECORD_NAME)
    except ValueError:
        return False
    return isinstance(meta, dict) and {"method", "settings", "data_config", "base_model"} <= meta.keys()


def read_train_record(parser: argparse.ArgumentParser, heads: Path, flag: str = "--heads") -> dict:
    """A train-draft output's `train_draft.json`, read bounded (a regular file of at most 64 MiB, strict JSON:
    config/user_files.py); a missing or bad one is the parser's usage error (exit status 2), before any model loads.
    For the commands that measure a trained output's heads on its held-out prompts (`--heads`, `--held_out_from`).
    """
    try:
        meta = read_user_json(Path(heads) / RECORD_NAME, f"{flag} {heads}: {RECORD_NAME}")
    except ValueError as e:
        parser.error(str(e))
    if not isinstance(meta, dict) or not isinstance(meta.get("eval_prompt_ids"), list):
        parser.error(f"{flag} {heads}: {RECORD_NAME} is not a train-draft record (no eval_prompt_ids list)")
    return meta


def claim_train_output(model_dir: str | Path, data_files: Sequence[str | Path], output_dir: str | Path,
                       cache_dir: str | Path | None = None, other_inputs: Sequence[str | Path] = ()) -> Path:
    """Claim `output_dir` (and an explicit `cache_dir`) for a trainer before anything is written; return the cache
    directory (default `output_dir/train_cache`). A trainer overwrites config.json, model.safetensors and
    train_draft.json there, so a directory it did not write, the base model or a data file is refused
    (`build/output_files.py`).

    Raises:
        OutputPathError: naming the directory, what it holds and the way out.
    """
    inputs = [model_dir, *data_files, *other_inputs]
    if cache_dir is not None:  # both checked before either is created or marked
        claim_output_dir(output_dir, "train-draft", inputs, is_train_output, check_only=True)
        claim_output_dir(cache_dir, "train-draft", inputs, is_train_cache, flag="--cache_dir", check_only=True)
    out = claim_output_dir(output_dir, "train-draft", inputs, is_train_output)
    if cache_dir is None:
        return out / "train_cache"
    return claim_output_dir(cache_dir, "train-draft", inputs, is_train_cache, flag="--cache_dir")


_CACHE_ENTRY = re.compile(r"(data-[0-9a-f]+\.pt|generations-[0-9a-f]+\.jsonl|train_state_\w+\.pt|engines|\..*\.tmp)")


def is_train_cache(cache: Path) -> bool:
    """A data cache a trainer wrote (an earlier run's OUT/train_cache, shared with `--cache_dir`): only its files."""
    return all(_CACHE_ENTRY.fullmatch(p.name) for p in cache.iterdir())


@dataclass
class Prepared:
    """The frozen base (`transformers`, float32), its self-distillation data, and the clock of the run."""

    model_dir: Path
    model: torch.nn.Module
    data: SelfDistillData
    data_key: str
    start: float  # time.perf_counter() at the start
    cpu_start: float  # time.process_time() at the start
    data_seconds: dict[str, float]  # wall-clock: load_base, generate (engine build included), hidden
    data_cpu_seconds: float
    deadline: float | None  # time.perf_counter() after which training stops

    @property
    def lm_head(self) -> torch.Tensor:
        """The base's head [V, H] as its logits use it: ÷ Granite's `logits_scaling` (1 elsewhere)."""
        return self.model.lm_head.weight.detach() / (getattr(self.model.config, "logits_scaling", None) or 1.0)


def prepare(model_dir: str | Path, data_cfg: DataConfig, settings: TrainSettings, cache_dir: str | Path
            ) -> Prepared:
    """Load the base and make (or load from `cache_dir`) its self-distillation data; start the run's clock."""
    from nextn.build.engine_cache import checkpoint_files
    from nextn.build.fingerprint import fingerprint

    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(settings.seed)
    deadline = start + 60 * settings.max_minutes if settings.max_minutes is not None else None
    model, _ = load_base(model_dir)
    load_seconds = time.perf_counter() - start
    data = make_self_distill_data(model_dir, model, data_cfg, cache_dir=cache_dir, progress=settings.progress,
                                  deadline=deadline)
    seconds = {"load_base": load_seconds, **data.seconds}
    data = data.with_context(settings.max_context)
    files = checkpoint_files(Path(model_dir))
    data_key = data_cfg.key(fingerprint(files, root=files[0].parent if len(files) == 1 else None))
    return Prepared(Path(model_dir), model, data, data_key, start, cpu_start, seconds,
                    time.process_time() - cpu_start, deadline)


@dataclass
class TrainResult:
    """What a trainer did; `top1_*` are per head / draft step / module, full-vocabulary argmax, teacher-forced on
    held-out sequences."""

    method: str  # "medusa", "mtp", "student"
    mode: str  # "medusa", "eagle" or "vanilla"
    num_heads: int  # Medusa heads, MTP modules
    num_draft_steps: int  # draft tokens the heads were trained for
    steps: int  # optimizer steps asked for
    steps_done: int
    complete: bool  # False: the time budget stopped training (the same command resumes it)
    final_loss: float
    top1_before: list[float]
    top1_after: list[float]
    num_train: int  # training sequences
    num_held_out: int  # held-out prompts (never trained on)
    num_tokens_generated: int  # tokens the base generated (training and top-1 sequences)
    loss_vocab_size: int
    seconds: dict[str, float]  # wall-clock: load_base, generate, hidden (0 when the data was cached), train
    cpu_seconds: dict[str, float]  # this process's CPU time: data, train
    held_out_prompts: list[list[int]] = field(repr=False, default_factory=list)  # evaluation prompts' token ids


def finish(prep: Prepared, method: str, mode: str, num_heads: int, num_draft_steps: int, settings: TrainSettings,
           fit_result, top1_before: list[float], loss_vocab_size: int, output_dir: str | Path,
           data_cfg: DataConfig, **extra: object) -> TrainResult:
    """The run's `TrainResult`, also written to `output_dir/train_draft.json` with the split (held-out ids, the
    evaluation prompts' ids and token ids), the data and training settings, and `extra`."""
    data = prep.data
    train_seconds = time.perf_counter() - prep.start - sum(prep.data_seconds.values())
    result = TrainResult(method, mode, num_heads, num_draft_steps, settings.steps, fit_result.steps_done,
                         fit_result.complete, fit_result.loss, top1_before, fit_result.top1, data.num_train,
                         len(data.held_out), data.num_tokens_generated, loss_vocab_size,
                         {**prep.data_seconds, "train": train_seconds},
                         {"data": prep.data_cpu_seconds,
                          "train": time.process_time() - prep.cpu_start - prep.data_cpu_seconds},
                         data.held_out_prompts)
    record = {**asdict(result), **extra, "resumed_from": fit_result.resumed_from, "chat": data.chat,
              "data_config": asdict(data_cfg), "settings": asdict(settings), "base_model": str(prep.model_dir),
              "eval_prompt_ids": list(data.eval_prompts), "held_out_ids": data.held_out,
              "train_prompt_ids": data.prompt_ids[: data.num_train]}
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RECORD_NAME).write_text(json.dumps(record) + "\n")
    return result
