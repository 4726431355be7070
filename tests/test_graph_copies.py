"""runtimes/graph_copies.py: what can be checked without a GPU (the replays themselves run on the H100 only:
docs/KV_CACHE.md)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from hstu_export.runtimes.graph_copies import Memcpy3DParms, direct_copy, graph_copies, loaded_library
from hstu_export.runtimes.kv_graphs import copy_alone


def test_memcpy_params_have_the_cuda_runtimes_layout() -> None:
    # cudaMemcpy3DParms on x86-64 (cuda_runtime_api.h of CUDA 12.8, compiled and read with offsetof).
    assert ctypes.sizeof(Memcpy3DParms) == 160
    assert (Memcpy3DParms.srcPtr.offset, Memcpy3DParms.dstPtr.offset) == (32, 96)
    assert (Memcpy3DParms.extent.offset, Memcpy3DParms.kind.offset) == (128, 152)


def test_the_loaded_cuda_runtime_is_found_in_the_memory_map(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f02-7f03 r--p 00000000 00:00 0\n"  # anonymous: no path
        "7f04-7f05 r-xp 00000000 08:01 13 /opt/py/nvidia/cu13/lib/libcudart.so.13\n"
        "7f06-7f07 r-xp 00000000 08:01 14 /opt/my libs/libcudart_static_helper.so\n"
    )
    assert loaded_library("libcudart.so", str(maps)) == "/opt/py/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_library("libnvrtc.so", str(maps)) is None
    assert loaded_library("libcudart.so", str(tmp_path / "missing")) is None
    spaced = tmp_path / "spaced"
    spaced.write_text("7f00-7f01 r-xp 00000000 08:01 12 /opt/my libs/libcudart.so.12\n")
    assert loaded_library("libcudart.so", str(spaced)) == "/opt/my libs/libcudart.so.12"


def test_which_requests_a_copy_node_takes_as_they_are() -> None:
    buffer = torch.zeros(8, 4, dtype=torch.bfloat16)
    assert direct_copy(torch.ones(5, 4, dtype=torch.bfloat16), buffer)
    assert direct_copy(torch.ones(8, 4, dtype=torch.bfloat16), buffer)
    assert not direct_copy(torch.ones(9, 4, dtype=torch.bfloat16), buffer)  # more rows than the bucket's
    assert not direct_copy(torch.ones(0, 4, dtype=torch.bfloat16), buffer)  # nothing to copy
    assert not direct_copy(torch.ones(4, 5, dtype=torch.bfloat16)[:, :4], buffer)  # not contiguous
    assert not direct_copy(torch.ones(5, 4), buffer)  # another dtype
    assert not direct_copy(torch.ones(5, 2, dtype=torch.bfloat16), buffer)  # another row shape (a narrower table)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA torch loads the CUDA runtime")
def test_without_the_cuda_runtime_requests_are_copied_before_the_replay() -> None:
    # A CPU torch loads no CUDA runtime: no graph copies, whatever the graph.
    assert graph_copies(object(), {}, {}) is None  # type: ignore[arg-type]


def test_an_input_a_node_cannot_take_is_written_into_the_bucket() -> None:
    pages = torch.zeros(1, 10, 4, 1, 1)  # the scratch page is the last: 9
    static = {"uih_item_emb": torch.full((6, 2), -1.0), "kv_page_table": torch.full((3, 8), 5, dtype=torch.int32),
              "kv_k_pages": pages}
    request = {"uih_item_emb": torch.arange(8.0).reshape(4, 2), "kv_page_table": torch.tensor([[1, 2, 3], [4, 5, 6]],
               dtype=torch.int32), "kv_k_pages": pages}  # fmt: skip
    copy_alone(static, request, "uih_item_emb")
    assert static["uih_item_emb"][:4].equal(request["uih_item_emb"])
    assert static["uih_item_emb"][4:].eq(-1).all()  # the padding user's rows are left as they were
    copy_alone(static, request, "kv_page_table")  # narrower than the bucket: its later columns the scratch page
    assert static["kv_page_table"].tolist() == [[1, 2, 3, 9, 9, 9, 9, 9], [4, 5, 6, 9, 9, 9, 9, 9], [5] * 8]
