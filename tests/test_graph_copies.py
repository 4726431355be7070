"""runtimes/graph_copies.py: what can be checked without a GPU (the replays themselves run on the H100 only:
docs/KV_CACHE.md)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
from pathlib import Path

import pytest
import torch

from hstu_export.runtimes import kv_graphs
from hstu_export.runtimes.graph_copies import Memcpy3DParms, direct_copy, graph_copies, loaded_library
from hstu_export.runtimes.kv_graphs import collection_paused, copy_alone


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


def test_no_garbage_collection_runs_inside_the_block() -> None:
    collections: list[str] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append("inside" if inside else "after")

    thresholds = gc.get_threshold()
    gc.callbacks.append(note)
    try:
        gc.set_threshold(1, 1, 1)  # a collection falls due at nearly every allocation
        inside = False
        with collection_paused():
            inside = True
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
            inside = False
        made = [[] for _ in range(1000)]
        del made
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*thresholds)
    assert "inside" not in collections and "after" in collections
    assert gc.isenabled()
    gc.disable()  # a collector already off stays off, also when the block raises
    try:
        with pytest.raises(ValueError), collection_paused():
            raise ValueError
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_overlapping_captures_keep_the_collector_off_until_the_last_ends() -> None:
    # Two threads' captures overlap: the first to end must not turn the collector back on under the other.
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: list[bool] = []

    def first() -> None:
        with collection_paused():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    def second() -> None:
        first_in.wait(5)
        with collection_paused():
            second_in.set()
            first_out.wait(5)
            seen.append(gc.isenabled())

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert seen == [False] and gc.isenabled()


def test_a_bucket_is_captured_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CUDA calls faked: what is checked is that the collector is off while the capture runs the program,
    # and on while it warms up and afterwards (a collection mid-capture aborted the process on the H200:
    # benchmarks/investigations/capture_collection.py).
    class Stream:
        def wait_stream(self, other: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda **kwargs: object())
    monkeypatch.setattr(torch.cuda, "graph", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(kv_graphs, "cuda_runtime", lambda: None)
    runs: list[bool] = []

    class Cache(kv_graphs.GraphCache):
        def _run_bucket(self, static: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            runs.append(gc.isenabled())
            return {}

    cache = Cache(lambda **inputs: {}, kv_graphs.Buckets(history=8, candidates=8, max_width=4), contextual=0)
    cache._capture({"kv_cached": torch.zeros(2, dtype=torch.int64)})
    assert runs == [True, True, False]  # two warm-up runs, then the capture
    assert gc.isenabled()
