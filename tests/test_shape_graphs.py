"""ShapeGraphs' bookkeeping (runtimes/shape_graphs.py), on the CPU: capture=False keeps the buffers and the
keys as CUDA graphs would, and a replay calls the program on the buffers."""

from __future__ import annotations

import pytest
import torch

from hstu_export.runtimes.shape_graphs import ShapeGraphs, shape_key


def _program(calls: list[int], **options: int) -> ShapeGraphs:
    """A program that writes its rows into ``pages`` (a static input) at ``slots`` and returns the rows doubled
    and their sum."""

    def fn(rows: torch.Tensor, slots: torch.Tensor, pages: torch.Tensor) -> dict[str, torch.Tensor]:
        calls.append(rows.shape[0])
        pages[slots] = rows
        return {"out": rows * 2, "total": rows.sum(0, keepdim=True)}

    return ShapeGraphs(fn, ["pages"], max_graphs=2, capture=False, **options)


def test_a_shape_seen_twice_is_replayed_with_each_calls_values() -> None:
    pages, calls = torch.zeros(8, 3), []
    graphs = _program(calls)
    for k in range(4):  # the same shapes, other values each time
        rows = torch.arange(6.0).reshape(2, 3) + 10 * k
        slots = torch.tensor([k, k + 4])
        got = graphs({"rows": rows, "slots": slots, "pages": pages})
        assert torch.equal(got["out"], rows * 2) and torch.equal(got["total"], rows.sum(0, keepdim=True))
        assert torch.equal(pages[slots], rows)  # written into the caller's pages, not a copy of them
    assert graphs.counts == {"eager": 1, "captures": 0, "replays": 3, "refused": 0}
    got["out"].fill_(-1)  # what a caller holds is its own: the next replay is not changed by it, nor changes it
    again = graphs({"rows": torch.ones(2, 3), "slots": torch.tensor([0, 1]), "pages": pages})
    assert torch.equal(again["out"], torch.full((2, 3), 2.0)) and bool((got["out"] == -1).all())


def test_keys_are_the_shapes_dtypes_and_the_static_inputs_addresses() -> None:
    pages, other = torch.zeros(8, 3), torch.zeros(8, 3)
    base = {"rows": torch.ones(2, 3), "slots": torch.tensor([0, 1]), "pages": pages}
    key = shape_key(base, ["pages"])
    assert key == shape_key({**base, "rows": torch.zeros(2, 3)}, ["pages"])  # values are not part of it
    assert key != shape_key({**base, "rows": torch.ones(3, 3), "slots": torch.tensor([0, 1, 2])}, ["pages"])
    assert key != shape_key({**base, "rows": torch.ones(2, 3, dtype=torch.float64)}, ["pages"])
    assert key != shape_key({**base, "pages": other}, ["pages"])  # other pages: another graph


def test_graphs_are_kept_for_the_most_recent_shapes_only() -> None:
    pages, calls = torch.zeros(16, 3), []
    graphs = _program(calls)

    def call(n: int) -> None:
        rows = torch.randn(n, 3)
        got = graphs({"rows": rows, "slots": torch.arange(n), "pages": pages})
        assert torch.allclose(got["out"], rows * 2)

    for n in (1, 1, 2, 2, 3, 3):  # three shapes, each seen twice: two graphs kept (max_graphs=2)
        call(n)
    assert graphs.counts == {"eager": 3, "captures": 0, "replays": 3, "refused": 0} and len(graphs._graphs) == 2
    call(1)  # its graph was dropped, but the shape was seen: it is taken again at once
    assert graphs.counts["replays"] == 4 and graphs.counts["eager"] == 3


def test_a_shape_that_cannot_be_captured_runs_as_it_is_from_then_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    graphs = _program(calls)
    tried = []

    def refuse(inputs: dict[str, torch.Tensor]) -> None:
        tried.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", refuse)
    pages = torch.zeros(8, 3)
    for k in range(3):
        rows = torch.full((2, 3), float(k))
        got = graphs({"rows": rows, "slots": torch.tensor([0, 1]), "pages": pages})
        assert torch.equal(got["out"], rows * 2)
    assert graphs.counts == {"eager": 2, "captures": 0, "replays": 0, "refused": 1} and len(tried) == 1


def test_a_call_with_more_input_bytes_than_the_bound_runs_as_it_is() -> None:
    pages, calls = torch.zeros(16, 3), []
    graphs = _program(calls, max_bytes=4 * 3 * 4 + 4 * 8)  # four float rows and four slots
    for n in (5, 5, 5, 4, 4, 4):  # five rows are over the bound: never captured, however often seen
        rows = torch.randn(n, 3)
        got = graphs({"rows": rows, "slots": torch.arange(n), "pages": pages})
        assert torch.equal(got["out"], rows * 2)
    assert graphs.counts == {"eager": 4, "captures": 0, "replays": 2, "refused": 0}


def test_a_call_run_as_it_is_does_not_hold_the_others_back() -> None:
    """A shape seen for the first time runs outside the lock: while it is still running on one thread, a replay
    of another shape finishes on another (serving threads share one predictor)."""
    import threading

    started, release, waited = threading.Event(), threading.Event(), []

    def fn(rows: torch.Tensor) -> dict[str, torch.Tensor]:
        if rows.shape[0] == 5:  # the slow call of a new shape, until the other call is answered
            started.set()
            waited.append(release.wait(timeout=10))
        return {"out": rows * 2}

    graphs = ShapeGraphs(fn, [], capture=False)
    for _ in range(2):  # two rows: seen, then replayed
        graphs({"rows": torch.ones(2, 3)})
    slow = threading.Thread(target=graphs, args=({"rows": torch.ones(5, 3)},))
    slow.start()
    assert started.wait(timeout=30)
    got = graphs({"rows": torch.full((2, 3), 4.0)})  # would wait on the slow call if it held the lock
    release.set()
    slow.join(timeout=30)
    assert waited == [True]  # the replay was answered while the slow call ran
    assert torch.equal(got["out"], torch.full((2, 3), 8.0)) and not slow.is_alive()
    assert graphs.counts == {"eager": 2, "captures": 0, "replays": 2, "refused": 0}


def test_without_eviction_a_full_table_runs_new_shapes_as_they_are() -> None:
    """``evict=False`` (whole requests): the first ``max_graphs`` shapes keep their graphs, and a later shape seen
    any number of times is never captured, so that changing shapes cost a bounded number of captures."""
    pages, calls = torch.zeros(16, 3), []
    graphs = _program(calls, evict=False)
    for n in (1, 1, 2, 2, 3, 3, 3, 1, 2):  # two graphs kept (max_graphs=2); three rows never get one
        rows = torch.randn(n, 3)
        got = graphs({"rows": rows, "slots": torch.arange(n), "pages": pages})
        assert torch.equal(got["out"], rows * 2)
    assert graphs.counts == {"eager": 5, "captures": 0, "replays": 4, "refused": 0}
    assert sorted(key[1][1][0] for key in graphs._graphs) == [1, 2]  # the rows' shapes of the graphs kept
