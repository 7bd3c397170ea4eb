"""Training draft heads on a frozen base by self-distillation (`nextn train-draft`): MTP modules, Medusa heads, and
a distilled DeepSeek-V3 student; the tiny DeepSeek-V3-format checkpoint writer and its MTP self-distillation
(`tiny_checkpoint.py`, `mtp_distill.py`: `nextn demo`, the student's layout, the tests' fixtures)."""

from nextn.train.data import DataConfig, SelfDistillData, load_base, make_self_distill_data
from nextn.train.session import TrainResult, TrainSettings

__all__ = ["DataConfig", "SelfDistillData", "TrainResult", "TrainSettings", "load_base", "make_self_distill_data"]
