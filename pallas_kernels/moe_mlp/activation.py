"""The expert activations inside the fused kernels (Triton and Mosaic GPU): the
formulas of ``reference.hidden`` with erfc computed by a polynomial (no erf in
Triton; the same code lowers in Mosaic GPU). float32 in, float32 out.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _erfc(z: jax.Array) -> jax.Array:
    """erfc(z) in float32 by Numerical Recipes' ``erfcc`` (fractional error < 1.2e-7):
    erfc(|z|) = t exp(-z^2 + P(t)), t = 1 / (1 + |z| / 2); erfc(-z) = 2 - erfc(z)."""
    a = jnp.abs(z)
    t = 1.0 / (1.0 + 0.5 * a)
    coeffs = (0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
              -0.18628806, 0.09678418, 0.37409196, 1.00002368, -1.26551223)
    poly = jnp.zeros_like(t)
    for c in coeffs:  # Horner, highest power first
        poly = poly * t + c
    ans = t * jnp.exp(poly - a * a)
    return jnp.where(z >= 0, ans, 2.0 - ans)


def _gelu(v: jax.Array) -> jax.Array:
    """Exact GELU v * Phi(v) = v/2 * erfc(-v / sqrt 2), float32."""
    return 0.5 * v * _erfc(v * -math.sqrt(0.5))


def activate(gate: jax.Array | None, up: jax.Array, activation: str) -> jax.Array:
    """The kernels' ``reference.hidden``: same formulas, erfc by ``_erfc``."""
    if activation == "gelu":
        return _gelu(up)
    if activation == "swiglu":
        return gate * (1.0 / (1.0 + jnp.exp(-gate))) * up
    return _gelu(gate) * up
