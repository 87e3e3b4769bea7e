from aristax.pallas_kernels.ragged_dot.api import ragged_dot

__all__ = ["ragged_dot"]
