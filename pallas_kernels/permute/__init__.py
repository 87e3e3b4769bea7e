"""Permute (token -> expert order) and combine (expert -> token order, weighted)."""

from aristax.pallas_kernels.permute.api import combine, permute
from aristax.pallas_kernels.permute.triton import PermuteTiles

__all__ = ["PermuteTiles", "combine", "permute"]
