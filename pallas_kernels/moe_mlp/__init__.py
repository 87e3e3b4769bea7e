"""The fused expert MLP of the dropless MoE: gather, gate/up, activation, down, combine."""

from aristax.pallas_kernels.moe_mlp.api import fused_backend, moe_mlp
from aristax.pallas_kernels.moe_mlp.mosaic_gpu import GateUpTiles, MosaicMoeMlpTiles
from aristax.pallas_kernels.moe_mlp.triton import MoeMlpTiles

__all__ = ["GateUpTiles", "MoeMlpTiles", "MosaicMoeMlpTiles", "fused_backend", "moe_mlp"]
