"""The user code for exporting TorchEasyRec's ``DlrmHSTU``: a factory that builds it from the snapshot's own
KuaiRand config (tables shrunk), and example inputs in the model's own format (its ``Batch``).

Nothing of TorchEasyRec is edited or copied: the factory reads ``tzrec/tests/configs/dlrm_hstu_kuairand_1k.config``
from the installed ``tzrec`` and calls its classes. Put a TorchEasyRec checkout with compiled protos on
PYTHONPATH before importing this module; docs/TORCHEASYREC.md says how.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import torch
from google.protobuf import json_format

# Workaround, environment: pyfg, graphlearn and common_io are wheels TorchEasyRec downloads from its own server,
# not from the package index. Importing tzrec imports every dataset and feature module; building the model and
# running it without feature generation (fg_mode FG_NONE) never calls them, the imports only have to succeed.
for _name in ("pyfg", "common_io", "graphlearn", "graphlearn.python.data.values"):
    sys.modules.setdefault(_name, mock.MagicMock())


# Workaround, environment: TorchEasyRec pins grpcio-tools < 1.63 (protobuf 4) and reads its module configs with
# MessageToDict(including_default_value_fields=True), an argument protobuf 5.26 removed; the onnx here needs
# protobuf >= 6.31. This gives the argument its protobuf 4 meaning: unset scalars outside a oneof at their defaults.
def _with_defaults(message):
    for f in message.DESCRIPTOR.fields:
        if f.message_type is None and not (f.is_repeated or f.containing_oneof or message.HasField(f.name)):
            setattr(message, f.name, f.default_value)
        elif f.message_type is not None and not f.message_type.GetOptions().map_entry:
            for value in getattr(message, f.name) if f.is_repeated else [getattr(message, f.name)] * message.HasField(f.name):
                _with_defaults(value)
    return message


_message_to_dict = json_format.MessageToDict
json_format.MessageToDict = lambda message, including_default_value_fields=False, **kwargs: _message_to_dict(
    _with_defaults(type(message).FromString(message.SerializeToString())) if including_default_value_fields
    else message, always_print_fields_with_no_presence=including_default_value_fields, **kwargs)

import tzrec  # noqa: E402
from torchrec import JaggedTensor, KeyedJaggedTensor  # noqa: E402
from tzrec.datasets.utils import BASE_DATA_GROUP, Batch  # noqa: E402
from tzrec.features.feature import create_features  # noqa: E402
from tzrec.models.dlrm_hstu import DlrmHSTU  # noqa: E402
from tzrec.ops import Kernel  # noqa: E402
from tzrec.utils.config_util import load_pipeline_config  # noqa: E402
from tzrec.utils.state_dict_util import init_parameters  # noqa: E402

CONFIG = Path(tzrec.__file__).parent / "tests" / "configs" / "dlrm_hstu_kuairand_1k.config"
CONTEXTUAL = {"user_id": 1000, "user_active_degree": 8, "follow_user_num_range": 9, "fans_user_num_range": 9,
              "friend_user_num_range": 8, "register_days_range": 8}  # feature: rows, with the tables shrunk to 1000
ITEMS = 1000


def build_ranker(rows: int = 1000, seed: int = 0) -> DlrmHSTU:
    """The KuaiRand ``DlrmHSTU`` of the snapshot's test configs (D=512, 4 heads of 128, 3 STU layers, nine
    tasks), with every table larger than ``rows`` cut to ``rows`` and tzrec's PyTorch kernels."""
    config = load_pipeline_config(str(CONFIG))
    for feature in config.feature_configs:
        kind = feature.WhichOneof("feature")
        subs = feature.sequence_feature.features if kind == "sequence_feature" else [feature]
        for sub in subs:
            inner = getattr(sub, sub.WhichOneof("feature"))
            if "num_buckets" in inner.DESCRIPTOR.fields_by_name and inner.num_buckets > rows:
                inner.num_buckets = rows
    torch.manual_seed(seed)
    model = DlrmHSTU(config.model_config, create_features(config.feature_configs),
                     list(config.data_config.label_fields))
    init_parameters(model, torch.device("cpu"))  # tzrec builds its tables on the meta device
    model.set_kernel(Kernel.PYTORCH)  # plain PyTorch ops on a CPU; hstu-export maps them back to Triton on CUDA
    model.set_is_inference(True)
    return model.eval()


def example_batch(history: list[int], candidates: list[int], seed: int = 0) -> Batch:
    """A ``Batch`` as tzrec's data pipeline gives it to the model: every id feature in one KeyedJaggedTensor of
    the base data group (one id per user for the contextual features), the raw sequence features as
    JaggedTensors by name."""
    gen = torch.Generator().manual_seed(seed)
    b, n, c = len(history), sum(history), sum(candidates)
    ids = [torch.randint(0, rows, (b,), generator=gen) for rows in CONTEXTUAL.values()]
    ids += [torch.randint(0, ITEMS, (n,), generator=gen), torch.randint(0, ITEMS, (c,), generator=gen)]
    sparse = KeyedJaggedTensor.from_lengths_sync(
        [*CONTEXTUAL, "uih_seq__video_id", "cand_seq__video_id"], torch.cat(ids),
        torch.tensor([1] * (len(CONTEXTUAL) * b) + history + candidates))
    uih, cand = torch.tensor(history), torch.tensor(candidates)
    sequences = {
        "uih_seq__action_timestamp": JaggedTensor(
            1_700_000_000 + torch.randint(0, 10**6, (n, 1), generator=gen), lengths=uih),
        "uih_seq__action_weight": JaggedTensor(torch.randint(0, 256, (n, 1), generator=gen), lengths=uih),
        "uih_seq__watch_time": JaggedTensor(600 * torch.rand(n, 1, generator=gen), lengths=uih),
        "cand_seq__query_time": JaggedTensor(torch.full((c, 1), 1_701_000_000), lengths=cand),
    }
    return Batch(sparse_features={BASE_DATA_GROUP: sparse}, sequence_dense_features=sequences)
