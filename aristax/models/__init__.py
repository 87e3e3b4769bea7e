"""Models built on aristax layers: Mixtral with Hugging Face import/export."""

from aristax.models.generate import generate
from aristax.models.mixtral import (
    DecodeWeights,
    KVCache,
    Mixtral,
    MixtralConfig,
    MixtralOutput,
    forward,
)

__all__ = ["DecodeWeights", "KVCache", "Mixtral", "MixtralConfig", "MixtralOutput",
           "forward", "generate"]
