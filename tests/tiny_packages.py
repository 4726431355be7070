"""The tiny preset exported on TorchScript, as the serving tests serve it (conftest's tiny_serving_package and
its second version; tests/test_publish.py)."""

from __future__ import annotations

from pathlib import Path


def export_tiny(root: Path, seed: int, max_batch: int = 4) -> Path:
    """The tiny preset with the weights of ``seed``, exported under ``root`` (TorchScript, ``max_batch`` users a
    call); requests of one schema whatever the seed."""
    from hstu_export import ExportSettings, VerifySettings, export, generate_batch, save_bundle
    from hstu_export.models import build_preset

    model = build_preset("tiny", seed=seed)
    bundle = save_bundle(model, root / f"tiny{seed}.pt", generate_batch(model.input_schema(), 4, seed=6))
    settings = ExportSettings(backend="torchscript", max_batch_size=max_batch,
                              verify=VerifySettings(num_random_batches=1))
    return Path(export(bundle, root / "ranker.torchscript", settings).path)
