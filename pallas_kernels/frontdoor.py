"""The one backend-choice rule shared by every op's ``api.py``.

Every op has the same registry shape: ``BACKENDS = {name: backend module}`` and
``DEFAULT_ORDER = {jax platform: (names...)}``. Every backend module follows one
protocol: ``check(<the op's operands>, *, interpret)`` raises ``NotImplementedError``
with its reason when the backend cannot serve the call (its forward and backward),
and the op's functions (``gmm``/``tgmm``, ``route``, ``permute``/``combine`` and their
backwards, ``moe_mlp``) compute it. A call names a backend, an ordered list of
backends, or None (the platform default, always ending in "reference"); ``choose``
returns the first whose ``check`` accepts, before anything runs. When none serves, the
error lists every backend's reason, so a failing reference is never hidden.

Pallas backends run compiled on GPU and in interpret mode on CPU: ``interpret=None``
means "interpret iff the default backend is the CPU"; ``jax.export(...,
platforms=["cuda"])`` on a CPU machine passes ``interpret=False`` to lower the real
kernel.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Implementation = str | Sequence[str] | None


def is_count(value: Any) -> bool:
    """An integer (Python or NumPy) that is not a bool: ``True`` is no top_k."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def group_sizes_array(op: str, group_sizes: Any) -> Any:
    """``group_sizes`` as an array (a list or tuple becomes a NumPy one); when concrete
    (not traced), ValueError naming ``op`` unless every size is in [0, 2**31 - 1] (the
    int32 the kernels take; a larger int64 wrapped silently before)."""
    if isinstance(group_sizes, (list, tuple)):
        group_sizes = np.asarray(group_sizes)
    if hasattr(group_sizes, "dtype") and not isinstance(group_sizes, jax.core.Tracer):
        sizes = np.asarray(group_sizes)
        if np.issubdtype(sizes.dtype, np.integer) and sizes.size and (
                sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
            raise ValueError(f"{op}: group_sizes={sizes.tolist()} must be in [0, 2**31 - 1]: "
                             "rows per group")
    return group_sizes


def check_num_valid(op: str, num_valid: Any) -> None:
    """ValueError naming ``op`` unless ``num_valid`` is None or an integer scalar."""
    if num_valid is not None and (jnp.shape(num_valid) not in ((), (1,))
                                  or not jnp.issubdtype(jnp.result_type(num_valid),
                                                        jnp.integer)):
        raise ValueError(f"{op}: num_valid must be an integer scalar (or None); got "
                         f"{jnp.result_type(num_valid)}{list(jnp.shape(num_valid))}")


def guard_second_derivative(op: str, name: str, grads: Callable[..., Any], *args: Any) -> Any:
    """``grads(*args)``, the backward of backend ``name`` of ``op``. A second reverse
    derivative (grad of grad) differentiates it with JAX where JAX can (at the call's
    matmul precision); where JAX cannot (loops with traced trip counts, Pallas
    kernels), a ``NotImplementedError`` names the way out ("reference", which plain JAX
    autodiff differentiates to any order) instead of JAX's error from inside a loop."""
    precision = matmul_precision()

    @jax.custom_vjp
    def call(*args):
        return grads(*args)

    def second_derivative(args, cotangents):
        try:
            with jax.default_matmul_precision(precision):
                return jax.vjp(grads, *args)[1](cotangents)
        except (ValueError, TypeError, NotImplementedError) as err:
            raise NotImplementedError(
                f"{op}: backend {name!r} computes first derivatives only here, so a second "
                "reverse derivative (grad of grad) is not available on it; pass "
                "implementation='reference' (MoEConfig(implementation='reference') for the "
                "layer), which JAX differentiates to any order") from err

    call.defvjp(lambda *args: (grads(*args), args), second_derivative)
    return call(*args)


def matmul_precision() -> str | None:
    """The ``jax.default_matmul_precision`` in effect now. A kernel op's ``custom_vjp``
    takes it at the call and traces its backward under it: the backward is traced
    later, outside a context that held only the forward call (``Mixtral`` sets one)."""
    return jax.config.jax_default_matmul_precision


def candidates(
    op: str,
    registry: Mapping[str, Any],
    default_order: Mapping[str, Sequence[str]],
    implementation: Implementation,
) -> tuple[str, ...]:
    """The backend names to try, in order, validated against ``registry``."""
    if implementation is None:
        names = tuple(default_order.get(jax.default_backend(), ("reference",)))
    elif isinstance(implementation, str):
        names = (implementation,)
    else:
        names = tuple(implementation)
    unknown = [n for n in names if n not in registry]
    if unknown or not names:
        raise ValueError(
            f"{op}: implementation={implementation!r} is invalid; use None, a name, or "
            f"an ordered list of names from {sorted(registry)}"
        )
    return names


def named(implementation: Implementation) -> list[str]:
    """The backend names ``implementation`` gives, in order (none for None)."""
    if implementation is None:
        return []
    return [implementation] if isinstance(implementation, str) else list(implementation)


def with_reference(implementation: str | Sequence[str],
                   registry: Mapping[str, Any]) -> list[str]:
    """The names of ``implementation`` that an op's ``registry`` has, in order, ending
    in "reference": the lenient rule of a layer, which runs each op on the named
    kernels where they serve and on the reference elsewhere."""
    names = [n for n in named(implementation) if n in registry]
    return names if "reference" in names else names + ["reference"]


def tiles_for(tiles: Any, name: str) -> Any:
    """A call's ``tiles=`` for backend ``name``: a mapping {backend name: tiles} gives
    that backend's entry (None when it has none); anything else is passed as is."""
    return tiles.get(name) if isinstance(tiles, Mapping) else tiles


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret=None`` -> interpret mode iff JAX's default backend is the CPU."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


# Backends written in plain jnp/lax: never interpreted.
PLAIN_XLA: tuple[str, ...] = ("reference", "xla")


def interprets(implementation: Implementation) -> bool:
    """Whether ``implementation`` names a Pallas backend (not only plain-XLA ones,
    ``PLAIN_XLA``) and kernels run in interpret mode here (``interpret=None`` on the
    CPU)."""
    return (any(name not in PLAIN_XLA for name in named(implementation))
            and resolve_interpret(None))


def choose(
    op: str,
    backends: Mapping[str, Any],
    names: Sequence[str],
    *args: Any,
    interpret: bool,
) -> str:
    """The first of ``names`` whose backend module's ``check(*args, interpret=)``
    accepts the call. ``NotImplementedError`` listing every backend's reason when none
    does."""
    reasons = []
    for name in names:
        try:
            backends[name].check(*args, interpret=interpret)
        except NotImplementedError as err:  # backends may name themselves already
            reason = str(err)
            reasons.append(reason if reason.startswith(f"{name}:") else f"{name}: {reason}")
        else:
            return name
    raise NotImplementedError(
        f"{op}: no backend in {list(names)} serves this call ("
        + "; ".join(reasons)
        + "); add 'reference' to the list or change the inputs"
    )
