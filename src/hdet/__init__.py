"""hdet: Hyperparameter-Divergent Ensemble Training (arXiv 2604.24708) on torch.distributed."""

from .controller import FitController, PaperController, gamma_as_printed, gamma_decay, softmax_weights
from .flat import contiguous_parameters_
from .config import HDETConfig
from .ensemble import Ensemble, NonFiniteReplicaError, ReplicaMismatchError, ReplicaSyncError, SyncRecord
from .hyper import (AdamBeta, Dropout, GradClip, Hyperparameter, LabelSmoothing, Setter, Spread, WeightDecay,
                    group_params)
from .warm_init import warm_init_
from .replicas import ProcessGroupReplicas, Replicas, SingleReplica
from .replay import ReplayLR
from .scheduler_state import RankState
from .schedulers import HDETLR, OneCycleAutoLR
from .spread import Dealer, linear_multipliers
from .swap import SwappedInError
from .sweep import SweepResult, lr_sweep
from .telemetry import SyncLogger, sync_scalars
from .engine import ReplicaEngine  # (and hdet.engine, hdet.attention after a plain `import hdet`)

__version__ = "0.1.0"

__all__ = [
    "OneCycleAutoLR",
    "ReplicaEngine",
    "HDETLR",
    "RankState",
    "warm_init_",
    "linear_multipliers",
    "Dealer",
    "PaperController",
    "FitController",
    "softmax_weights",
    "gamma_as_printed",
    "gamma_decay",
    "Ensemble",
    "HDETConfig",
    "SyncRecord",
    "NonFiniteReplicaError",
    "ReplicaSyncError",
    "ReplicaMismatchError",
    "SwappedInError",
    "Replicas",
    "SingleReplica",
    "ProcessGroupReplicas",
    "Hyperparameter",
    "Spread",
    "WeightDecay",
    "AdamBeta",
    "Dropout",
    "LabelSmoothing",
    "GradClip",
    "Setter",
    "group_params",
    "ReplayLR",
    "SyncLogger",
    "sync_scalars",
    "contiguous_parameters_",
    "lr_sweep",
    "SweepResult",
]
