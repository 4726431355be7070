"""Capture: from a user's model to an FX graph (tracer, proxies for KeyedJaggedTensors, opaque calls, the
functions that stay single call nodes in graphs).

``trace`` is the entry point; passes/ and runtimes/ take it from there.
"""

from hstu_export.capture.tracer import (
    DEFAULT_LEAF_MODULES,
    EMBEDDING_MODULES,
    HstuTracer,
    module_matches,
    trace,
)

__all__ = ["DEFAULT_LEAF_MODULES", "EMBEDDING_MODULES", "HstuTracer", "module_matches", "trace"]
