"""count_compiles: the XLA compilations inside a block (shared test helper)."""

import contextlib

import jax


@contextlib.contextmanager
def count_compiles():
    """Counts XLA backend compilations inside the block."""
    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
