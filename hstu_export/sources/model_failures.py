"""The user's model failing while export runs it (traced, observed by the passes, as verification's
reference): said as that, with the file and line of the model's code and the likely cause, rather than as
an error of ours.

A failure is the model's when its traceback passes through the model's own code (any module that is not
torch, torchrec, fbgemm, triton or ours: a user's package, generative-recommenders, TorchEasyRec). The
likely causes are matched on the failure's message and on the frames it went through (``CAUSES``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hstu_export.capture.opaque import is_library_module
from hstu_export.errors import ExportError, HstuExportError, ModelRunError, PassError

# Our errors that wrap a failure of running the graph (observe_values, the split graphs on a second
# example); other errors of ours that chain a model's exception (a failed trace) say something else.
RUN_WRAPPERS = (PassError, ExportError)


@dataclass(frozen=True)
class Cause:
    """A likely cause: a failure whose message contains one of ``messages``, on a device of type ``device``
    ("" for any), that went through the package ``through`` (when given)."""

    messages: tuple[str, ...]
    advice: str
    device: str = ""
    through: str = ""


CAUSES = (
    Cause(("active drivers",), "a Triton kernel launched on a CPU, which Triton cannot run: build the "
          "model with its PyTorch kernels (TorchEasyRec: kernel: PYTORCH; generative-recommenders: "
          "set_hammer_kernel(HammerKernel.PYTORCH)); hstu-export maps those back onto its own Triton kernels for "
          "CUDA", device="cpu", through="triton"),
    Cause(("Torch not compiled with CUDA", "Found no NVIDIA driver", "no CUDA GPUs are available",
           "CUDA driver initialization failed"),
          "the model puts tensors on CUDA itself (a fixed device= in its code or config) while the export runs "
          "it on this machine's CPU: build it for the export device, or export with --device cuda on a GPU machine",
          device="cpu"),
    Cause(("from the 'CUDA' backend",), "an op of the model has no CUDA kernel in this installation: "
          "--reference-device cpu runs the model on the CPU while the package is compiled for CUDA",
          device="cuda"),
    Cause(("from the 'CPU' backend",), "an op of the model has no CPU kernel in this installation (a CUDA-only "
          "library build): export with --device cuda on a GPU machine, or install the library's CPU build",
          device="cpu"),
    Cause(("Expected all tensors to be on the same device",), "the model keeps or creates tensors on another "
          "device than the one it is run on (a buffer left out of its modules, a fixed device= in its code)"),
)


@contextlib.contextmanager
def running_model(device: torch.device, what: str) -> Iterator[None]:
    """Inside the block, a failure of the model's own code becomes a ModelRunError (``what``: what export
    was doing, e.g. "tracing it")."""
    try:
        yield
    except Exception as exc:
        failure = model_failure(exc, device, what)
        if failure is None:
            raise
        raise failure from exc


def model_failure(exc: BaseException, device: torch.device, what: str) -> ModelRunError | None:
    """``exc`` as a ModelRunError when it came out of the model's own code, else None."""
    raised = exc
    if isinstance(exc, HstuExportError):
        if not isinstance(exc, RUN_WRAPPERS) or exc.__cause__ is None or isinstance(exc.__cause__, HstuExportError):
            return None
        raised = exc.__cause__
    frames = list(_frames(raised.__traceback__))
    user = [(f, line) for f, line in frames if not is_library_module(f.f_globals.get("__name__", "_"))]
    if not user:
        return None
    frame, line = user[-1]
    text = (str(raised).strip().splitlines() or [""])[0][:300].rstrip(".")
    message = f"{type(raised).__name__}: {text}" if text else type(raised).__name__
    cause = likely_cause(raised, frames, device)
    return ModelRunError(
        f"the model fails when run on {device.type} ({what}) at {frame.f_code.co_filename}:{line}: {message}"
        + (f"; likely cause: {cause}" if cause else "")
    )


def likely_cause(exc: BaseException, frames: list[tuple[types.FrameType, int]], device: torch.device) -> str:
    text = str(exc)
    modules = {f.f_globals.get("__name__", "").partition(".")[0] for f, _ in frames}
    for cause in CAUSES:
        if cause.device and cause.device != device.type:
            continue
        if any(m in text for m in cause.messages) and (not cause.through or cause.through in modules):
            return cause.advice
    return ""


def _frames(tb: types.TracebackType | None) -> Iterator[tuple[types.FrameType, int]]:
    while tb is not None:
        yield tb.tb_frame, tb.tb_lineno
        tb = tb.tb_next
