"""The model zoo: HSTU ranking model, transducer, STU layers and the named presets."""

from hstu_export.models.config import PRESETS, HSTUConfig, preset_config
from hstu_export.models.ranking import HstuRankingModel, HstuSparseArch, MultiTaskHeads, ranking_input_schema
from hstu_export.models.stu import STULayer, STUStack
from hstu_export.models.transducer import ContextualPreprocessor, HSTUTransducer, PositionalEncoder


def build_preset(name: str, seed: int = 0) -> HstuRankingModel:
    """A seeded ranking model of a named preset (random init)."""
    import torch

    config = preset_config(name)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = HstuRankingModel(config)
    return model.eval()


__all__ = [
    "PRESETS",
    "ContextualPreprocessor",
    "HSTUConfig",
    "HSTUTransducer",
    "HstuRankingModel",
    "HstuSparseArch",
    "MultiTaskHeads",
    "PositionalEncoder",
    "STULayer",
    "STUStack",
    "build_preset",
    "preset_config",
    "ranking_input_schema",
]
