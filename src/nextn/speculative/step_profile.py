"""A step profile: an engine's decode-step time on this machine per batch-size bucket and draft length, measured
once (runtime/step_profiler.py) and cached, so that `AdaptiveDraftLen` knows what speculation costs from its first
step instead of exploring (speculative/draft_len_policy.py).

    step_time  {batch-size bucket (a power of two): {draft length k: seconds of one decode step}}; k = 0 is a plain
               step (no drafter), k ≥ 1 verifies k drafts while the drafter drafts K
    key        what the times depend on: the engine (a digest of its manifest, the drafter's config and the step's
               settings), the processor it ran on, torch's thread count, the torch and nextn versions

A profile lives in `<cache dir>/step-profile-<engine digest[:32]>.json` (default cache dir
`~/.cache/nextn/step_profiles`): one file per engine identity, so a run on another CPU, thread count or version
finds it, logs one line naming what it was measured on, and measures again (`cached_step_profile`). Reading is
bounded (config/user_files.py, `MAX_PROFILE_BYTES`; a symbolic link is refused) and validated; writing is atomic
and never replaces a file that is not in the step-profile format (build/output_files.py, nextn's rule for every
file it writes), only ever at that name in the cache dir.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import re
from pathlib import Path
from typing import Final, Literal

import torch
from torch import device as Device  # (ProfileKey has a field named torch)
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

import nextn
from nextn.build.output_files import OutputPathError, write_output_file
from nextn.config.user_files import read_user_bytes

__all__ = ["DEFAULT_PROFILE_DIR", "MAX_PROFILE_BYTES", "ProfileKey", "StepProfile", "StepProfileError",
           "cached_step_profile", "engine_digest", "load_step_profile", "profile_path", "save_step_profile"]

logger = logging.getLogger(__name__)

DEFAULT_PROFILE_DIR = Path.home() / ".cache" / "nextn" / "step_profiles"
MAX_PROFILE_BYTES = 1 << 20  # a profile is a few hundred bytes; anything bigger is not one
MAX_BUCKET = 1 << 16  # = config.llm_args.MAX_BATCH_SIZE
MAX_DRAFT_LEN = 255  # = config.llm_args.MAX_TREE_DRAFT_TOKENS (a tree's k counts its nodes)
MAX_STEP_SECONDS = 3600.0
_FORMAT: Final = "nextn.step_profile"
_OURS = re.compile(rb'^\s*\{\s*"format"\s*:\s*"nextn\.step_profile"')  # how a profile file starts (`StepProfile`)


class StepProfileError(ValueError):
    """A step-profile file that cannot be read or written: its path and why."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ProfileKey(_Frozen):
    """What a profile's step times depend on; a profile is used only where every field matches."""

    engine: str = Field(pattern=r"^[0-9a-f]{64}$")  # `engine_digest` of the engine and the step's settings
    processor: str = Field(max_length=256)  # the CPU model (and the GPU's name on a CUDA device)
    threads: int = Field(ge=1, le=1 << 16)  # torch.get_num_threads()
    torch: str = Field(max_length=64)
    nextn: str = Field(max_length=64)

    @classmethod
    def current(cls, engine: str, device: Device) -> "ProfileKey":
        """This process's key for the engine digest `engine` on `device`."""
        processor = cpu_model()
        if device.type == "cuda":
            processor = f"{torch.cuda.get_device_name(device)} + {processor}"
        return cls(engine=engine, processor=processor[:256], threads=torch.get_num_threads(),
                   torch=torch.__version__, nextn=nextn.__version__)

    def machine(self) -> str:
        """'<processor>/<threads> threads (torch <v>, nextn <v>)', for log lines."""
        return f"{self.processor}/{self.threads} threads (torch {self.torch}, nextn {self.nextn})"


class StepProfile(_Frozen):
    """One engine's measured step times on one machine (see the module docstring)."""

    format: Literal["nextn.step_profile"] = _FORMAT
    version: Literal[1] = 1
    key: ProfileKey
    engine_name: str = Field(max_length=256)  # the engine directory's name, for log lines
    measure_seconds: float = Field(ge=0.0)  # how long measuring took
    step_time: dict[int, dict[int, float]]  # bucket → {k: seconds}
    #: buckets the measurement's time budget left to the policy's online timing (`runtime/step_profiler.py`)
    left_online: list[int] = Field(default_factory=list, max_length=17)

    @field_validator("left_online")
    @classmethod
    def _buckets(cls, buckets: list[int]) -> list[int]:
        bad = [b for b in buckets if not 1 <= b <= MAX_BUCKET or b & (b - 1)]
        if bad:
            raise ValueError(f"left_online buckets {bad[:4]} are not powers of two in [1, {MAX_BUCKET}]")
        return buckets

    @field_validator("step_time")
    @classmethod
    def _table(cls, table: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
        if not table:
            raise ValueError("step_time is empty")
        for bucket, times in table.items():
            if not 1 <= bucket <= MAX_BUCKET or bucket & (bucket - 1):
                raise ValueError(f"step_time bucket {bucket} is not a power of two in [1, {MAX_BUCKET}]")
            if 0 not in times or len(times) < 2:
                raise ValueError(f"step_time[{bucket}] needs a plain step (k = 0) and a speculating one")
            for k, seconds in times.items():
                if not 0 <= k <= MAX_DRAFT_LEN or not 0.0 < seconds <= MAX_STEP_SECONDS:
                    raise ValueError(f"step_time[{bucket}][{k}] = {seconds}: k must be in [0, {MAX_DRAFT_LEN}] and "
                                     f"seconds in (0, {MAX_STEP_SECONDS}]")
        return table


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first "model name"; else what `platform` knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def engine_digest(*parts: str) -> str:
    """SHA-256 (hex) of the parts that make an engine's steps what they are (its manifest, the drafter's config,
    the step's settings), each length-prefixed."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def profile_path(cache_dir: str | Path, engine: str) -> Path:
    """Where the profile of engine digest `engine` lives in `cache_dir`."""
    return Path(cache_dir) / f"step-profile-{engine[:32]}.json"


def load_step_profile(path: str | Path) -> StepProfile:
    """Read and validate a step-profile file.

    Raises:
        StepProfileError: a symbolic link or not a regular file, over `MAX_PROFILE_BYTES`, or not the JSON of a
            step profile (the message names the path and the first bad field).
    """
    path = Path(path)
    if path.is_symlink():
        raise StepProfileError(f"the step profile {path} is a symbolic link: a step profile is a file nextn writes")
    data = read_user_bytes(path, "the step profile", StepProfileError, MAX_PROFILE_BYTES)
    try:
        return StepProfile.model_validate_json(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the file"
        raise StepProfileError(f"{path} is not a valid step profile: {where}: {first['msg']}") from None


def save_step_profile(profile: StepProfile, cache_dir: str | Path) -> Path:
    """Write `profile` to its place in `cache_dir` (created if missing), atomically.

    Returns:
        The file written.
    Raises:
        StepProfileError: a file is there that is not in the step-profile format (never replaced), a symbolic link,
            or the directory cannot be written.
    """
    path = profile_path(cache_dir, profile.key.engine)
    try:
        return write_output_file(path, profile.model_dump_json(indent=1) + "\n", "the step profile",
                                 is_ours=lambda head: bool(_OURS.match(head)))
    except (OutputPathError, OSError) as e:
        raise StepProfileError(f"cannot write the step profile {path}: {e}") from None


def cached_step_profile(cache_dir: str | Path, key: ProfileKey, engine_name: str) -> StepProfile | None:
    """The cached profile for `key`, or None when it must be measured: none cached, or one measured elsewhere
    (another processor, thread count or version: logged in one line), or an unreadable file (logged, with why)."""
    path = profile_path(cache_dir, key.engine)
    if not path.exists() and not path.is_symlink():
        return None
    try:
        profile = load_step_profile(path)
    except StepProfileError as e:
        logger.warning("%s; measuring the step profile again", e)
        return None
    if profile.key == key:
        return profile
    if profile.key.engine == key.engine:
        logger.warning("step profile for %s was measured on %s, this is %s; re-profiling", engine_name,
                       profile.key.machine(), key.machine())
    return None
