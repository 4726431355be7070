"""hstu-export: export compiler for HSTU generative-recommender models.

Python API (release scripts):

    import hstu_export
    bundle = hstu_export.load_bundle("model.pt")
    batch = hstu_export.generate_batch(bundle.input_schema, batch_size=8, seed=1)
"""

from __future__ import annotations

__version__ = "0.1.0"

from hstu_export.batch import generate_batch
from hstu_export.bundle import ModelBundle, load_bundle, save_bundle
from hstu_export.errors import HstuExportError
from hstu_export.registry import build_model, register_model, registered_models
from hstu_export.schema import FeatureSpec, InputSchema

__all__ = [
    "FeatureSpec",
    "HstuExportError",
    "InputSchema",
    "ModelBundle",
    "__version__",
    "build_model",
    "generate_batch",
    "load_bundle",
    "register_model",
    "registered_models",
    "save_bundle",
]
