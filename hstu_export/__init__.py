"""hstu-export: export compiler for HSTU generative-recommender models.

Python API (release scripts):

    import hstu_export
    bundle = hstu_export.load_bundle("model.pt")
    batch = hstu_export.generate_batch(bundle.input_schema, batch_size=8, seed=1)
    gm = hstu_export.trace(bundle.model, bundle.example_batch, leaf_modules=["MyBlock"])
    ctx = hstu_export.PassContext(example_inputs=bundle.example_batch, model=bundle.model)
    result = hstu_export.run_passes(gm, ctx)      # result.sparse, .dense, .boundary, .report

    settings = hstu_export.ExportSettings(backend="aoti", max_batch_size=16)
    hstu_export.export("model.pt", "model.aoti", settings)   # verified, written atomically
    predictor = hstu_export.load("model.aoti")               # checks checksums, versions, device
    scores = predictor(batch)
"""

from __future__ import annotations

from hstu_export.errors import HstuExportError
from hstu_export.package.schema import FeatureSpec, InputSchema
from hstu_export.sources.bundle import ModelBundle, load_bundle, save_bundle
from hstu_export.sources.registry import build_model, register_model, registered_models
from hstu_export.verification.batch import generate_batch
from hstu_export.version import __version__


def _source_checkout_subpackages() -> None:
    """Uninstalled source checkout (PYTHONPATH=repo): the top-level passes/ and runtimes/ directories are
    the ``hstu_export.passes`` and ``hstu_export.runtimes`` subpackages, as an install maps them."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    here = Path(__file__).resolve().parent
    if (root / "passes" / "__init__.py").is_file() and not (here / "passes").exists() and str(root) not in __path__:
        __path__.append(str(root))


_source_checkout_subpackages()


# Tracing and the pass pipeline import torch.fx and torchrec (seconds): loaded on first use so that
# `hstu-export --help` and bundle handling stay fast.
_LAZY = {
    "trace": "hstu_export.capture",
    "run_passes": "hstu_export.passes.manager",
    "PassContext": "hstu_export.passes.context",
    "PipelineResult": "hstu_export.passes.manager",
    "BoundarySchema": "hstu_export.passes.boundary",
    "export": "hstu_export.exporter",
    "ExportResult": "hstu_export.exporter",
    "ExportSettings": "hstu_export.settings",
    "VerifySettings": "hstu_export.settings",
    "EmbeddingQuantization": "hstu_export.settings",
    "load": "hstu_export.runtimes.predictor",
    "Predictor": "hstu_export.runtimes.predictor",
    "verify_package": "hstu_export.verification.packages",
    "infer_schema": "hstu_export.sources.schema_inference",
    "flatten_example": "hstu_export.sources.schema_inference",
    "ExportHints": "hstu_export.sources.hints",
    "ArgumentSpec": "hstu_export.package.schema",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hstu_export' has no attribute {name!r}")


__all__ = [
    "ArgumentSpec",
    "BoundarySchema",
    "EmbeddingQuantization",
    "ExportHints",
    "ExportResult",
    "ExportSettings",
    "FeatureSpec",
    "HstuExportError",
    "InputSchema",
    "ModelBundle",
    "PassContext",
    "PipelineResult",
    "Predictor",
    "VerifySettings",
    "__version__",
    "build_model",
    "export",
    "flatten_example",
    "generate_batch",
    "infer_schema",
    "load",
    "load_bundle",
    "register_model",
    "registered_models",
    "run_passes",
    "save_bundle",
    "trace",
    "verify_package",
]
