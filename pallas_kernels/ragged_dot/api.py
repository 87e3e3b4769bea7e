"""The front door of the grouped GEMM: validation and backend choice.

Backends are tried in order; one that cannot serve a call raises
``NotImplementedError`` and the next is tried. The reference always serves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from aristax.pallas_kernels.ragged_dot import reference

BACKENDS: dict[str, Callable[..., jax.Array]] = {"reference": reference.ragged_dot}
DEFAULT_ORDER: tuple[str, ...] = ("reference",)


def _candidates(implementation: str | Sequence[str] | None) -> tuple[str, ...]:
    names = DEFAULT_ORDER if implementation is None else (
        (implementation,) if isinstance(implementation, str) else tuple(implementation)
    )
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names:
        raise ValueError(
            f"implementation={implementation!r} is invalid: use None or names from "
            f"{sorted(BACKENDS)}"
        )
    return names


def _validate(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K]; got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be [G, K, N]; got shape {rhs.shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"lhs [M, K]={lhs.shape} and rhs [G, K, N]={rhs.shape} disagree on K"
        )
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be an integer array of shape [G]=({rhs.shape[0]},); got "
            f"{group_sizes.dtype}{list(group_sizes.shape)}"
        )


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    implementation: str | Sequence[str] | None = None,
) -> jax.Array:
    """Grouped GEMM: out[m] = lhs[m] @ rhs[group of row m].

    Args:
      lhs: [M, K], rows grouped consecutively. rhs: [G, K, N].
      group_sizes: int32[G] rows per group (sum <= M; later rows give zeros).
      preferred_element_type: accumulation/output dtype (e.g. float32 for bf16 inputs).
      implementation: backend name or ordered list of names; None = the best
        available for the platform, falling back to "reference".
    Returns:
      [M, N].
    """
    _validate(lhs, rhs, group_sizes)
    for name in _candidates(implementation):
        try:
            return BACKENDS[name](
                lhs, rhs, group_sizes.astype(jnp.int32),
                preferred_element_type=preferred_element_type,
            )
        except NotImplementedError:
            continue
    raise NotImplementedError(
        f"no backend in implementation={implementation!r} serves lhs {lhs.dtype}"
        f"{list(lhs.shape)}, rhs {rhs.dtype}{list(rhs.shape)}; add 'reference'"
    )
