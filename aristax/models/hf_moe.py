"""``aristax.models.hf_moe``: the Hugging Face MoE block converter under the models
namespace, where HF conversions live for users. The converter itself is
``aristax.hf_moe``: it depends only on the config and the layer function, so the NNX
``MoE.from_hf`` (below ``aristax.models``) can use it."""

from aristax.hf_moe import REFUSED, ROUTERS, SUPPORTED, RouterRule, from_hf, selection_bias, to_hf

__all__ = ["REFUSED", "ROUTERS", "SUPPORTED", "RouterRule", "from_hf", "selection_bias",
           "to_hf"]
