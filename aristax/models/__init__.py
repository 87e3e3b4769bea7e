"""Models built on aristax layers, with Hugging Face import/export: Mixtral and
Qwen3-MoE, two configurations of one shared decoder (``aristax.models.decoder``); single
Hugging Face MoE blocks convert through ``aristax.models.hf_moe``."""

from __future__ import annotations

import os

from aristax.models import hf, hf_moe
from aristax.models.decoder import DecoderLM, DecoderOutput
from aristax.models.generate import generate
from aristax.models.mixtral import (
    DecodeWeights,
    KVCache,
    Mixtral,
    MixtralConfig,
    MixtralOutput,
    forward,
)
from aristax.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig, Qwen3MoeOutput
from aristax.sharding import LOGICAL_DECODER_AXES, DecoderAxes

# config.json's model_type -> the class that loads it
MODELS: dict[str, type[DecoderLM]] = {"mixtral": Mixtral, "qwen3_moe": Qwen3Moe}


def model_class(config_json: dict) -> type[DecoderLM]:
    """The class of a checkpoint's config.json dict, by its ``model_type`` (a
    config.json without one is read as Mixtral's, as ``MixtralConfig.from_hf`` does)."""
    model_type = config_json.get("model_type", "mixtral")
    if model_type not in MODELS:
        raise ValueError(f"config.json has model_type={model_type!r}, which aristax does not "
                         f"support; supported: {', '.join(map(repr, MODELS))}")
    return MODELS[model_type]


def from_pretrained(directory: str | os.PathLike, **kwargs) -> DecoderLM:
    """Load a local Hugging Face checkpoint of any supported family (dispatched on
    config.json's ``model_type``); ``kwargs`` go to ``<Model>.from_pretrained``."""
    return model_class(hf.read_config_json(directory)).from_pretrained(directory, **kwargs)


__all__ = ["LOGICAL_DECODER_AXES", "MODELS", "DecodeWeights", "DecoderAxes", "DecoderLM",
           "DecoderOutput", "KVCache", "Mixtral", "MixtralConfig", "MixtralOutput",
           "Qwen3Moe", "Qwen3MoeConfig", "Qwen3MoeOutput", "forward", "from_pretrained",
           "generate", "hf_moe", "model_class"]
