"""count_compiles: the XLA compilations inside a block (shared test helper)."""

import contextlib

import jax


@contextlib.contextmanager
def count_compiles():
    """Counts the executables XLA makes inside the block: backend compilations and
    programs read from the persistent compilation cache (conftest sets one up, so a
    program another test compiled first comes from there)."""
    events = []

    def listener(event, duration, **kwargs):
        if event in ("/jax/core/compile/backend_compile_duration",
                     "/jax/compilation_cache/cache_retrieval_time_sec"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
