"""The one backend-choice rule shared by every op's ``api.py``.

An op has a registry ``{name: callable}`` and a default order per platform. A call
names a backend, an ordered list of backends, or None (the platform default, always
ending in "reference"). Backends are tried in order; one that cannot serve a call
raises ``NotImplementedError`` with its reason and the next is tried. When none serves,
the error lists every backend's reason, so a failing reference is never hidden.

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

Implementation = str | Sequence[str] | None


def is_count(value: Any) -> bool:
    """An integer (Python or NumPy) that is not a bool: ``True`` is no top_k."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def matmul_precision() -> str | None:
    """The ``jax.default_matmul_precision`` in effect now. A kernel op's ``custom_vjp``
    takes it at the call and traces its backward under it: the backward is traced
    later, outside a context that held only the forward call (``Mixtral`` sets one)."""
    return jax.config.jax_default_matmul_precision


def candidates(
    op: str,
    registry: Mapping[str, Callable[..., Any]],
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


def call_first(
    op: str,
    registry: Mapping[str, Callable[..., Any]],
    names: Sequence[str],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Call ``registry[name](*args, **kwargs)`` for the first name that serves."""
    reasons = []
    for name in names:
        try:
            return registry[name](*args, **kwargs)
        except NotImplementedError as err:
            reasons.append(f"{name}: {err}")
    raise NotImplementedError(
        f"{op}: no backend in {list(names)} serves this call ("
        + "; ".join(reasons)
        + "); add 'reference' to the list or change the inputs"
    )


def first_serving(
    op: str,
    backends: Mapping[str, Any],
    names: Sequence[str],
    *args: Any,
    interpret: bool,
) -> str:
    """The first of ``names`` whose backend module's ``check(*args, interpret=)``
    accepts the call (``call_first``'s rule and error, without running the op)."""
    def accepts(name):
        def check(*args):
            backends[name].check(*args, interpret=interpret)
            return name
        return check
    return call_first(op, {n: accepts(n) for n in names}, names, *args)
