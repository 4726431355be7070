"""A CUDA graph's copy nodes, pointed at each request's tensors before a replay (Python's side of what
runtimes/cpp/src/kv_graphs.cpp does).

A graph captured with ``torch.cuda.CUDAGraph(keep_graph=True)`` that starts by copying the request's tensors
into its buffers has a memcpy node per copy. Pointing each node at the next request's tensor
(``cudaGraphExecMemcpyNodeSetParams1D``) makes a call one launch, where copying before the replay costs a
launch per copy on the host. PyTorch's Python API has no call for it, so this module calls the CUDA runtime
that torch loaded, through ctypes. Where that runtime or one of its functions is not found, or a copy did not
become a memcpy node, :func:`graph_copies` returns None and the caller copies before the replay instead.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Mapping

import torch
from torch import Tensor

_MEMCPY_NODE = 1  # cudaGraphNodeTypeMemcpy
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice
_FUNCTIONS = ("cudaGraphGetNodes", "cudaGraphNodeGetType", "cudaGraphMemcpyNodeGetParams",
              "cudaGraphExecMemcpyNodeSetParams1D")


class _Pos(ctypes.Structure):
    _fields_ = [("x", ctypes.c_size_t), ("y", ctypes.c_size_t), ("z", ctypes.c_size_t)]


class _PitchedPtr(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("pitch", ctypes.c_size_t), ("xsize", ctypes.c_size_t),
                ("ysize", ctypes.c_size_t)]


class _Extent(ctypes.Structure):
    _fields_ = [("width", ctypes.c_size_t), ("height", ctypes.c_size_t), ("depth", ctypes.c_size_t)]


class Memcpy3DParms(ctypes.Structure):
    """``cudaMemcpy3DParms`` (cuda_runtime_api.h), what a memcpy node copies."""

    _fields_ = [("srcArray", ctypes.c_void_p), ("srcPos", _Pos), ("srcPtr", _PitchedPtr),
                ("dstArray", ctypes.c_void_p), ("dstPos", _Pos), ("dstPtr", _PitchedPtr),
                ("extent", _Extent), ("kind", ctypes.c_int)]


def loaded_library(stem: str, maps: str = "/proc/self/maps") -> str | None:
    """The path of the shared library ``stem`` (``libcudart.so``, any version) this process has loaded, from
    its memory map; None when there is none (or no memory map to read)."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (a path may hold spaces)
        name = os.path.basename(fields[5]) if len(fields) == 6 else ""
        if name == stem or name.startswith(stem + "."):
            return fields[5]
    return None


def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded, with the graph functions this module calls; None where it is not loaded
    (a CPU build of torch) or lacks one of them. Looked up again until found."""
    path = loaded_library("libcudart.so")
    return None if path is None else _runtime_at(path)


@functools.cache
def _runtime_at(path: str) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(path)
    except OSError:
        return None
    if not all(hasattr(lib, name) for name in _FUNCTIONS):
        return None
    lib.cudaGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    lib.cudaGraphNodeGetType.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.cudaGraphMemcpyNodeGetParams.argtypes = [ctypes.c_void_p, ctypes.POINTER(Memcpy3DParms)]
    lib.cudaGraphExecMemcpyNodeSetParams1D.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for name in _FUNCTIONS:
        getattr(lib, name).restype = ctypes.c_int
    return lib


class GraphCopyError(RuntimeError):
    """A call of the CUDA runtime's graph functions failed."""


def _check(status: int, what: str) -> None:
    if status != 0:
        raise GraphCopyError(f"CUDA graph: {what} failed (CUDA error {status})")


def direct_copy(value: Tensor, buffer: Tensor) -> bool:
    """Whether a copy node into ``buffer`` can take ``value`` as it is: one contiguous run of bytes of the
    buffer's dtype and row shape, and no more rows than the buffer has."""
    return (value.numel() > 0 and value.is_contiguous() and value.dtype == buffer.dtype
            and value.device == buffer.device and value.shape[1:] == buffer.shape[1:]
            and value.shape[0] <= buffer.shape[0])


class GraphCopies:
    """The memcpy nodes of a captured graph that copy ``sources`` (by name) into ``buffers``; instantiates the
    graph. :meth:`point` points them at a request's tensors."""

    def __init__(self, lib: ctypes.CDLL, graph: torch.cuda.CUDAGraph, buffers: Mapping[str, Tensor],
                 sources: Mapping[str, Tensor]) -> None:
        self._lib = lib
        raw = ctypes.c_void_p(graph.raw_cuda_graph())
        count = ctypes.c_size_t(0)
        _check(lib.cudaGraphGetNodes(raw, None, ctypes.byref(count)), "listing the nodes")
        nodes = (ctypes.c_void_p * count.value)()
        _check(lib.cudaGraphGetNodes(raw, nodes, ctypes.byref(count)), "listing the nodes")
        wanted = {(buffers[name].data_ptr(), value.data_ptr()): name for name, value in sources.items()}
        found: dict[str, ctypes.c_void_p] = {}
        for node in nodes:
            kind = ctypes.c_int(-1)
            _check(lib.cudaGraphNodeGetType(node, ctypes.byref(kind)), "reading a node's type")
            if kind.value != _MEMCPY_NODE:
                continue
            params = Memcpy3DParms()
            _check(lib.cudaGraphMemcpyNodeGetParams(node, ctypes.byref(params)), "reading a copy's parameters")
            name = wanted.get((params.dstPtr.ptr or 0, params.srcPtr.ptr or 0))
            if name is not None:
                found[name] = ctypes.c_void_p(node)
        missing = sorted(set(sources) - set(found))
        if missing:
            raise LookupError(f"no memcpy node copies {', '.join(missing)}")
        self.names = tuple(sources)
        self._nodes = [found[name] for name in self.names]
        self._pointed: list[tuple[int, int]] = [(0, 0)] * len(self.names)
        self._dummy = torch.zeros(2, dtype=torch.uint8, device=next(iter(buffers.values())).device)
        graph.instantiate()
        self._exec = ctypes.c_void_p(graph.raw_cuda_graph_exec())
        self.repointed = 0

    def point(self, buffers: Mapping[str, Tensor], inputs: Mapping[str, Tensor]) -> list[str]:
        """Points each node at its input in ``inputs``; returns the names of those it cannot take as they are
        (:func:`direct_copy`): their nodes then copy one byte of nothing, and the caller copies them."""
        left: list[str] = []
        for i, name in enumerate(self.names):
            value, buffer = inputs[name], buffers[name]
            direct = direct_copy(value, buffer)
            wanted = (value.data_ptr(), value.numel() * value.element_size()) if direct else (self._dummy.data_ptr(), 1)
            if wanted != self._pointed[i]:
                dst, src = (buffer.data_ptr(), wanted[0]) if direct else (wanted[0] + 1, wanted[0])
                _check(self._lib.cudaGraphExecMemcpyNodeSetParams1D(self._exec, self._nodes[i], dst, src, wanted[1],
                                                                    _DEVICE_TO_DEVICE), "pointing a copy")
                self._pointed[i] = wanted
                self.repointed += 1
            if not direct and value.numel() > 0:
                left.append(name)
        return left


def graph_copies(graph: torch.cuda.CUDAGraph, buffers: Mapping[str, Tensor],
                 sources: Mapping[str, Tensor]) -> GraphCopies | None:
    """:class:`GraphCopies` of a graph captured with ``keep_graph=True``, or None where the CUDA runtime's
    functions are not found or a copy is not a memcpy node (the graph is then still to instantiate)."""
    lib = cuda_runtime()
    if lib is None:
        return None
    try:
        return GraphCopies(lib, graph, buffers, sources)
    except (LookupError, GraphCopyError, AttributeError):  # AttributeError: a torch without raw_cuda_graph
        return None
