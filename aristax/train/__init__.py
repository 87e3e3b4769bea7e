"""Experiments: typed configs, the ``aristax train`` loop, data, checkpoints, metrics,
and the local multi-process launcher (``aristax launch``)."""

from aristax.train.config import ConfigError, TrainConfig, load_config
from aristax.train.trainer import RunResult, train

__all__ = ["ConfigError", "RunResult", "TrainConfig", "load_config", "train"]
