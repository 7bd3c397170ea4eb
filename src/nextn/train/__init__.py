"""Training draft models on a frozen base by self-distillation (`nextn train-draft`): Medusa heads."""

from nextn.train.data import SelfDistillData, load_base, make_self_distill_data
from nextn.train.medusa import MedusaTrainResult, train_medusa

__all__ = ["MedusaTrainResult", "SelfDistillData", "load_base", "make_self_distill_data", "train_medusa"]
