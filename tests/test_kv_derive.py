"""The KV delta program derived from a user's traced graph (hstu_export/kv_derive.py) and served through the
paged cache (serving/kv_derived.py): cached answers equal the model's on every request of a scripted
sequence, hits are served from the cache, changed prefixes are found stale, and models that cannot be
cached are refused naming why."""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kv_requests import held_rows_of
from test_fuse_stu_gate import GR_ATTENTION, on_the_cpu
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from user_models import dlrm_hstu, gr_style, tzrec_style

from hstu_export import ExportSettings
from hstu_export.capture import trace
from hstu_export.errors import ConfigError
from hstu_export.exporter import export_ranges
from hstu_export.kv_derive import (
    TARGET_ROWS,
    _Analysis,
    _computed_from,
    _without_dtype_reads,
    concat_by_search,
    concat_sources,
    counts_on_host,
    delta_rows,
    derive_delta,
    gathered_jagged,
    host_counts,
    jagged_right_rows,
    new_rows_of,
    nothing_cached,
    row_tolerance,
    row_width,
    rows_at,
    rows_back,
    sequence_counts,
    split_by_search,
    take_rows,
    target_rows_of,
)
from hstu_export.ops.mappings import function_mappings, imported_functions
from hstu_export.ops.reference import concat_2D_jagged_reference, split_2D_jagged_reference
from hstu_export.passes.context import PassContext
from hstu_export.passes.manager import run_passes
from hstu_export.runtimes.shape_graphs import ShapeGraphs
from hstu_export.serving.kv_derived import DerivedCachedRanker, EagerDerived
from hstu_export.sources.schema_inference import flatten_example, infer_schema

pytest.importorskip("triton")  # the graph is derived at the triton target, whose ops keep the attention a node

User = dict[str, list[int]]


class Setup:
    """A user model traced and split as an export does it, the attention kept as our op (its CPU kernel)."""

    def __init__(self, model: torch.nn.Module, example: tuple, keys: tuple[list[str], list[str]], ranges: dict,
                 attention_scale: str = "fixed:64", export_device: str = "cpu") -> None:
        self.model, self.keys = model.eval(), keys
        self.schema = infer_schema(model, example, ranges=ranges)
        flat = flatten_example(self.schema, example, None, model)
        mappings = {gr_style.ATTENTION: GR_ATTENTION}
        gm = trace(model, flat, schema=self.schema,
                   opaque_functions=imported_functions(list(function_mappings(mappings))))
        ctx = PassContext(example_inputs=self.schema.to_graph_inputs(flat), schema=self.schema, op_mappings=mappings,
                          op_target="triton", attention_scale=attention_scale, export_device=export_device,
                          ranges=export_ranges(self.schema, ExportSettings(max_batch_size=4)))
        self.result = on_the_cpu(run_passes(gm, ctx, skip=("fuse_stu_gate",)))
        self.example = self.dense_inputs(flat)

    def dense_inputs(self, flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        batch, boundary = self.schema.to_graph_inputs(flat), self.result.boundary
        sparse = self.result.sparse(**{t.name: batch[t.name] for t in boundary.sparse_inputs})
        return {t.name: sparse[t.name] if t.source == "sparse" else batch[t.name] for t in boundary.dense_inputs}

    def request(self, users: list[User]) -> dict[str, torch.Tensor]:
        kjts = [KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat([torch.tensor(u[k], dtype=torch.int64) for k in keys for u in users]),
            lengths=torch.tensor([len(u[k]) for k in keys for u in users])) for keys in self.keys]
        return flatten_example(self.schema, tuple(kjts), None, self.model)

    def full(self, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return self.result.dense(**self.dense_inputs(request))


def dlrm_setup(**kwargs: Any) -> Setup:
    return Setup(dlrm_hstu.build_ranker(), dlrm_hstu.example_inputs(3, seed=0),
                 (dlrm_hstu.UIH_KEYS, dlrm_hstu.CANDIDATE_KEYS),
                 {"uih_features": (1, 12), "candidates_features": (1, 5)}, **kwargs)


def gr_setup(**kwargs: Any) -> Setup:
    return Setup(gr_style.build_ranker(), gr_style.example_inputs([10, 5, 7], [3, 1, 2]),
                 (gr_style.UIH_KEYS, gr_style.CANDIDATE_KEYS), gr_style.RANGES, **kwargs)


def dlrm_user(seed: int, history: int, candidates: int) -> User:
    g = torch.Generator().manual_seed(seed)
    return {"uih_item_id": torch.randint(0, 500, (history,), generator=g).tolist(),
            "uih_action": torch.randint(0, 8, (history,), generator=g).tolist(),
            "uih_time": sorted((1_700_000_000 + torch.randint(0, 10**6, (history,), generator=g)).tolist()),
            "cand_item_id": torch.randint(0, 500, (candidates,), generator=g).tolist(),
            "cand_category": torch.randint(0, 20, (candidates,), generator=g).tolist()}


def gr_user(seed: int, history: int, candidates: int) -> User:
    g = torch.Generator().manual_seed(seed)
    return {"user_id": [seed % gr_style.USERS],
            "uih_item_id": torch.randint(0, gr_style.ITEMS, (history,), generator=g).tolist(),
            "uih_action": torch.randint(0, gr_style.ACTIONS, (history,), generator=g).tolist(),
            "cand_item_id": torch.randint(0, gr_style.ITEMS, (candidates,), generator=g).tolist()}


def new_candidates(user: User, seed: int, keys: list[str], count: int = 2) -> User:
    g = torch.Generator().manual_seed(seed)
    return {**user, **{k: torch.randint(0, 8, (count,), generator=g).tolist() for k in keys}}


def grown(user: User, uih_keys: list[str]) -> User:
    return {**user, **{k: user[k] + ([user[k][-1] + 1] if k != "user_id" else []) for k in uih_keys if k != "user_id"}}


def serve(setup: Setup, script: list[tuple[list[int], list[User]]]) -> tuple[DerivedCachedRanker, list[float]]:
    """Serves each (user ids, users) request through the derived cache; the worst difference per request
    from the full model on the same request."""
    ranker = DerivedCachedRanker(EagerDerived(setup.dense_inputs, derive_delta(setup.result.dense, setup.example)),
                                 budget_bytes="4MiB", page_size=16)
    worst = []
    for ids, users in script:
        request = setup.request(users)
        got, want = ranker(request, ids), setup.full(request)
        assert set(got) == set(want)
        worst.append(max(float((got[k] - want[k]).abs().max()) for k in want))
    return ranker, worst


@pytest.mark.parametrize("make, user", [(dlrm_setup, dlrm_user), (gr_setup, gr_user)], ids=["dlrm_hstu", "gr_style"])
def test_cached_answers_equal_the_model_on_every_request(make: Callable[..., Setup],
                                                         user: Callable[..., User]) -> None:
    setup = make()
    uih_keys, cand_keys = setup.keys
    a, b, c, d = (user(s, h, n) for s, h, n in ((1, 8, 3), (2, 4, 1), (3, 9, 3), (4, 6, 2)))
    script = [
        ([1, 2, 3], [a, b, c]),                                            # prefill
        ([3, 1, 2], [c, a, b]),                                            # the same users, reordered: hits
        ([1, 2, 3], [new_candidates(a, 5, cand_keys), new_candidates(b, 6, cand_keys, 4), c]),  # new candidates
        ([1, 4], [grown(a, uih_keys), d]),                                 # a grown history, a new user
        ([2, 2], [b, b]),                                                  # the same user twice: not stored
    ]
    ranker, worst = serve(setup, script)
    assert max(worst) < 1e-5, worst
    stats = ranker.cache.stats()
    assert stats["hits"] >= 6 and stats["misses"] == 4 and stats["bypassed"] == 2, stats


@pytest.mark.parametrize("export_device", ["cpu", "cuda"])
def test_a_torcheasyrec_style_model_is_served_through_its_derived_program(export_device: str) -> None:
    """tzrec_style (forward on a Batch dataclass; contextual tokens from pooled ids and dense features before
    the history) with a fixed attention length: the same batch again is all hits, new candidates for the same
    histories hit too, new histories of the same lengths are found stale; every answer is the model's. With the
    passes of a CUDA export its history projection (33 wide) reads its rows zero-padded (align_linear_inputs),
    and the derivation takes that layer as row-local."""
    import dataclasses

    from hstu_export.passes.align_linear_inputs import AlignedLinear

    model = tzrec_style.build_ranker()
    lengths = ([5, 3, 7], [2, 1, 3])
    setup = Setup(model, (tzrec_style.example_batch(*lengths),), ([], []), tzrec_style.RANGES,
                  export_device=export_device)
    aligned = [m for m in setup.result.dense.modules() if isinstance(m, AlignedLinear)]
    assert [(m.in_features, m.pad) for m in aligned] == ([(36, 3)] if export_device == "cuda" else [])

    def request(seed: int, candidate_seed: int | None = None) -> dict[str, torch.Tensor]:
        batch = tzrec_style.example_batch(*lengths, seed=seed)
        if candidate_seed is not None:
            other = tzrec_style.example_batch(*lengths, seed=candidate_seed)
            batch = dataclasses.replace(batch, sparse_features={**batch.sparse_features,
                                                                "candidate": other.sparse_features["candidate"]})
        return flatten_example(setup.schema, (batch,), None, model)

    ranker = DerivedCachedRanker(EagerDerived(setup.dense_inputs, derive_delta(setup.result.dense, setup.example)),
                                 budget_bytes="4MiB", page_size=16)
    seen = []
    for batch, stats in ((request(0), (3, 0, 0)), (request(0), (3, 3, 0)), (request(0, candidate_seed=5), (3, 6, 0)),
                         (request(1), (3, 6, 3))):
        got, want = ranker(batch, [1, 2, 3]), setup.full(batch)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        c = ranker.cache.stats()
        seen.append((c["misses"], c["hits"], c["stale"]))
        assert seen[-1] == stats, seen


def test_a_hit_computes_only_the_new_rows_and_a_changed_prefix_is_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """gr_style's time-free tokens: a user whose history is unchanged is a hit; changing one of its cached
    tokens is found by the frontier rows (stale, recomputed, still exact). The delta program reads back from the
    device only what the model's own graph reads (its count of new rows is given, not read)."""
    setup = gr_setup()
    a = gr_user(1, 8, 2)
    changed = {**a, "uih_item_id": [a["uih_item_id"][0] + 1, *a["uih_item_id"][1:]]}
    derived = derive_delta(setup.result.dense, setup.example)
    rows: list[int] = []  # the rows each call's first projection computes (the module is the model's own)
    derived.program.get_submodule("layers.0.uvqk").register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    ranker = DerivedCachedRanker(EagerDerived(setup.dense_inputs, derived), budget_bytes="4MiB", page_size=16)
    running, reads = [], {"delta": 0, "model": 0}
    for name, graph in (("delta", derived.program), ("model", setup.result.dense)):
        graph.register_forward_pre_hook(lambda m, args, name=name: running.append(name))
        graph.register_forward_hook(lambda m, args, out: running.clear())
    item = torch.Tensor.item

    def counted(t: torch.Tensor) -> object:
        if running:
            reads[running[0]] += 1
        return item(t)

    monkeypatch.setattr(torch.Tensor, "item", counted)
    for request in ([a], [a], [changed]):
        want = setup.full(setup.request(request))
        rows.pop()
        got = ranker(setup.request(request), [7])
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    # 1 contextual + 8 history + 2 candidates; a hit computes the candidates only; the changed history is first
    # run as a hit, found stale by that call, and run again from nothing.
    assert rows == [11, 2, 2, 11]
    assert {k: ranker.cache.stats()[k] for k in ("hits", "misses", "stale")} == {"hits": 1, "misses": 1, "stale": 1}
    assert reads["delta"] / 4 == reads["model"] / 3 > 0  # four program calls, three of the model


def _delta(offsets: torch.Tensor, targets: torch.Tensor | None, cached: torch.Tensor, frontier: list[torch.Tensor],
           pages: torch.Tensor, table: torch.Tensor, whole_history: bool = False) -> tuple:
    """delta_rows with the new rows a runtime gives it (new_rows_of, from the counts on the host)."""
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    stored = [n - t for n, t in zip(lengths, targets.tolist() if targets is not None else [0] * len(lengths))]
    return delta_rows(offsets, targets, cached, frontier, pages, table, new_rows_of(lengths, stored, cached.tolist()),
                      whole_history)


def test_new_rows_are_the_rows_past_each_cached_prefix() -> None:
    """new_rows_of lists, in order, each user's rows after its cached ones; a count beyond a user's stored
    (non-target) tokens counts as none, as delta_rows takes it."""
    assert new_rows_of([3, 5, 2], [2, 4, 2], [2, 4, 0]).tolist() == [2, 7, 8, 9]
    assert new_rows_of([3, 5], [2, 4], [3, -1]).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert new_rows_of([4], [4], [4]).tolist() == []


def test_stale_is_found_per_user_from_its_own_rows() -> None:
    """delta_rows on three users whose rows sit side by side: one changed cached row marks only its user
    stale; a user with nothing cached, a change past its cached prefix, or a change within the rounding of the
    row (the same row computed in another order) is not stale; NaN is."""
    lengths = torch.tensor([5, 4, 6])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.arange(15, dtype=torch.float32).reshape(15, 1).repeat(1, 3)
    page_size, width = 4, 2
    pages = torch.zeros(3 * width + 1, page_size, 3)
    table = torch.arange(3 * width, dtype=torch.int32).reshape(3, width)
    first = _delta(offsets, None, torch.zeros(3, dtype=torch.int64), [rows], pages, table)
    assert not first[4].any() and first[0].tolist() == list(range(15))
    cached = torch.tensor([4, 3, 0])
    rounding = row_tolerance(torch.float32) * 6 / 2  # row 6's largest value is 6
    for row, by, want in ((6, 1.0, [False, True, False]), (2, 1.0, [True, False, False]), (4, 1.0, [False, False, False]),
                          (12, 1.0, [False, False, False]), (6, rounding, [False, False, False]),
                          (6, 3 * rounding, [False, True, False]), (1, float("nan"), [True, False, False])):
        changed = rows.clone()
        changed[row, 1] += by  # user 0's rows 0-4, user 1's 5-8, user 2's 9-14
        stale = _delta(offsets, None, cached, [changed], pages.clone(), table)[4]
        assert stale.tolist() == want, (row, stale)
    # A NaN kept in the pages differs too, as does one in the request's row.
    kept = pages.clone()
    _delta(offsets, None, torch.zeros(3, dtype=torch.int64), [rows], kept, table)
    kept[int(table[1, 0]), 1, 2] = float("nan")  # user 1's second row
    assert _delta(offsets, None, cached, [rows], kept, table)[4].tolist() == [False, True, False]


def test_stale_users_are_those_with_a_changed_row_within_both_their_cached_prefix_and_their_page_table() -> None:
    """delta_rows' stale flags on random batches equal a row-by-row reading of the rule: a user is stale when a
    row before its cached count (a count beyond its stored tokens is none), in a page its table holds, differs
    from the row stored there. Users with no rows, none cached, and counts past the table's pages included."""
    generator = torch.Generator().manual_seed(5)
    page_size, width = 4, 3
    for _ in range(40):
        users = int(torch.randint(1, 6, (1,), generator=generator))
        lengths = torch.randint(0, 16, (users,), generator=generator)
        lengths[0] += 1  # a request has a row
        targets = torch.minimum(torch.randint(0, 3, (users,), generator=generator), lengths)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        total = int(offsets[-1])
        rows = torch.randn(total, 2, generator=generator)
        pages = torch.zeros(users * width + 1, page_size, 2)
        table = torch.arange(users * width, dtype=torch.int32).reshape(users, width)
        _delta(offsets, targets, torch.zeros(users, dtype=torch.int64), [rows], pages, table)  # stores them
        cached = torch.randint(-1, 16, (users,), generator=generator)
        changed, moved = rows.clone(), torch.rand(total, generator=generator) < 0.1
        changed[moved] += 1.0
        want = []
        for b in range(users):
            stored = int(lengths[b] - targets[b])
            count = int(cached[b]) if 0 <= int(cached[b]) <= stored else 0
            place = torch.arange(int(lengths[b]))
            compared = (place < count) & (place < width * page_size)
            want.append(bool((moved[int(offsets[b]):int(offsets[b + 1])] & compared).any()))
        stale = _delta(offsets, targets, cached, [changed], pages.clone(), table)[4]
        assert stale.tolist() == want, (lengths, cached, moved)


def test_the_stale_check_investigation_reduces_to_the_same_users_every_way() -> None:
    """benchmarks/investigations/stale_check.py's three reductions (on the CPU here) flag the same users as each
    other: none on the rows as stored, each user whose cached row 7 changed, and only those."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "investigations" / "stale_check.py"
    spec = importlib.util.spec_from_file_location("stale_check", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    offsets, cached, frontier, pages, table = script.inputs(3, "cpu")
    changed = frontier.clone()
    changed[offsets[1] + 7] += 1.0  # user 1's row 7
    changed[offsets[2] + script.CACHED] += 1.0  # user 2's first new row: not cached
    for reduce in (script.atomics, script.spread, script.per_page):
        assert reduce(offsets, cached, frontier, pages, table).tolist() == [False, False, False]
        assert reduce(offsets, cached, changed, pages, table).tolist() == [False, True, False]


@pytest.mark.parametrize("id_columns", [1, 5])  # 8 lanes of bf16 compared one by one; 24 in one reduction
def test_integer_frontier_rows_are_compared_bit_for_bit_in_the_pages_of_a_narrow_dtype(id_columns: int) -> None:
    """An integer frontier tensor (a position or bucket an embedding looks up) is stored in bf16 pages as its
    int64 bytes: a change of one in a value too large for bf16 (or for float32), in any of its columns, marks
    its user stale, the same values do not, and the floating rows beside them keep their tolerance."""
    lengths = torch.tensor([3, 4])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    floats = torch.linspace(-1, 1, 7 * 2).reshape(7, 2).to(torch.bfloat16)
    ids = 2**40 + torch.arange(7 * id_columns, dtype=torch.int64).reshape(7, id_columns)
    mask = torch.tensor([True, False, True, True, False, False, True])
    width = 2 + 4 * id_columns + 4
    assert row_width([floats[0], ids[0], mask[0]], torch.bfloat16) == width
    pages = torch.zeros(2 * 2 + 1, 4, width, dtype=torch.bfloat16)
    table = torch.arange(4, dtype=torch.int32).reshape(2, 2)
    _delta(offsets, None, torch.zeros(2, dtype=torch.int64), [floats, ids, mask], pages, table)
    stored = pages[int(table[1, 0]), 1, 2:2 + 4 * id_columns].view(torch.int64)  # user 1's second row: row 4
    assert stored.tolist() == ids[4].tolist()
    cached = torch.tensor([3, 3])
    for name, column, change, want in (("ids", 0, 1, [False, True]), ("ids", id_columns - 1, 1, [False, True]),
                                       ("mask", 0, True, [True, False]), ("floats", 0, 0.0, [False, False])):
        parts = {"floats": floats.clone(), "ids": ids.clone(), "mask": mask.clone()}
        row = 4 if name == "ids" else 1
        if name == "mask":
            parts["mask"][row] = ~parts["mask"][row]
        else:
            parts[name][row, column] += change
        frontier = [parts["floats"], parts["ids"], parts["mask"]]
        stale = _delta(offsets, None, cached, frontier, pages.clone(), table)[4]
        assert stale.tolist() == want, (name, column)


def test_outputs_never_read_the_rows_of_cached_tokens() -> None:
    """The rows the layers leave for cached tokens are NaN here: a hit's outputs are still the model's."""
    setup = gr_setup()
    derived = derive_delta(setup.result.dense, setup.example, fill=float("nan"))
    ranker = DerivedCachedRanker(EagerDerived(setup.dense_inputs, derived), budget_bytes="4MiB", page_size=16)
    request = setup.request([gr_user(1, 8, 2), gr_user(2, 3, 1)])
    ranker(request, [1, 2])
    got, want = ranker(request, [1, 2]), setup.full(request)
    assert ranker.cache.stats()["hits"] == 2
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


def test_target_rows_are_each_users_last_new_rows() -> None:
    """target_rows_of: each user's targets (its rows past the stored ones) as indices into new_rows_of's list."""
    lengths, stored = [5, 4, 6], [3, 4, 2]
    assert target_rows_of(lengths, stored, [0, 0, 0]).tolist() == [3, 4, 11, 12, 13, 14]  # all rows new
    new = new_rows_of(lengths, stored, [2, 4, 1])  # user 0: 3 new rows, user 1: none, user 2: 5
    picked = new[target_rows_of(lengths, stored, [2, 4, 1])].tolist()
    assert picked == [3, 4, 11, 12, 13, 14]  # the request's rows of the targets
    assert target_rows_of([3], [3], [9]).tolist() == []


@pytest.mark.parametrize("make", [dlrm_setup, gr_setup], ids=["dlrm_hstu", "gr_style"])
def test_the_counts_are_read_off_as_sums_of_request_lengths(make: Callable[..., Setup]) -> None:
    """host_counts: each user's sequence length and target count as sums of the counts program's inputs, equal to
    the program on lengths it was not derived on; a count the graph clamps is not a sum, and is left to the
    program."""
    setup = make()
    derived = derive_delta(setup.result.dense, setup.example)
    sums = derived.host_counts
    assert sums is not None and sums["num_targets"] == {"terms": {"candidates_features__cand_item_id__lengths": 1},
                                                        "constant": 0}
    names = [n.target for n in derived.counts.graph.nodes if n.op == "placeholder"]
    assert set(sums["seq_lengths"]["terms"]) == set(names) and set(sums["seq_lengths"]["terms"].values()) == {1}
    g = torch.Generator().manual_seed(3)
    lengths = {name: torch.randint(0, 50, (7,), generator=g) for name in names}
    for got, want in zip(counts_on_host(sums, lengths), derived.counts(**lengths), strict=True):
        assert torch.equal(got, want)
    clamped = copy.deepcopy(derived.counts)
    add = next(n for n in clamped.graph.nodes if n.op == "placeholder")
    with clamped.graph.inserting_after(add):
        capped = clamped.graph.call_method("clamp", (add,), {"max": 40})
    add.replace_all_uses_with(capped, delete_user_cb=lambda user: user is not capped)
    clamped.recompile()
    assert host_counts(clamped) is None


def test_counts_from_lengths_read_as_rows_of_their_concatenation_are_sums() -> None:
    """generative-recommenders' counts: the candidates' lengths of several features put one after another, viewed
    as rows, the first row taken; two contextual tokens a user. host_counts reads that as sums too."""
    g = torch.fx.Graph()
    history, candidates, other = (g.placeholder(name) for name in ("history", "candidates", "other"))
    first = g.call_function(operator.getitem, (g.call_method("view", (g.call_function(torch.cat, ([candidates, other],)),
                                                                       2, -1)), 0))  # fmt: skip
    lengths = g.call_function(operator.add, (g.call_function(operator.add, (history, first)), 2))
    offsets = g.call_function(F.pad, (g.call_function(torch.cumsum, (lengths,), {"dim": 0}), (1, 0)),
                              {"mode": "constant", "value": None})
    g.output(g.call_function(sequence_counts, (offsets, first)))
    counts = torch.fx.GraphModule(torch.nn.Module(), g)
    sums = host_counts(counts)
    assert sums == {"seq_lengths": {"terms": {"candidates": 1, "history": 1}, "constant": 2},
                    "num_targets": {"terms": {"candidates": 1}, "constant": 0}}
    inputs = {"history": torch.tensor([5, 0, 9]), "candidates": torch.tensor([2, 4, 1]), "other": torch.tensor([7, 7, 7])}
    for got, want in zip(counts_on_host(sums, inputs), counts(**inputs), strict=True):
        assert torch.equal(got, want)


def test_the_sources_of_a_jagged_concatenations_rows_give_its_rows() -> None:
    """concat_sources: each row of concat_2D_jagged is the left row or the right row it names (users with an empty
    side included), for every row and for some rows in any order; take_rows reads a side that may be empty through
    a zero row, and clamps a row past a side's own to its last one."""
    left_offsets, right_offsets = torch.tensor([0, 3, 3, 7, 8]), torch.tensor([0, 2, 3, 5, 5])
    left, right = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(5, 4)
    want = concat_2D_jagged_reference(left, left_offsets, right, right_offsets)
    for positions in (torch.arange(13), torch.tensor([12, 0, 5, 5, 9, 3])):
        from_left_rows, from_right_rows, from_left = concat_sources(left_offsets, right_offsets, positions)
        got = torch.where(from_left.unsqueeze(1), take_rows(left, from_left_rows, False),
                          take_rows(right, from_right_rows, False))
        assert got.equal(want[positions]), positions
    empty = torch.zeros(0, 4)
    assert take_rows(empty, torch.tensor([0, 3]), True).equal(torch.zeros(2, 4))
    assert take_rows(left, torch.tensor([0, 30]), False).equal(left[[0, 7]])


def test_boolean_rows_of_a_side_that_may_be_empty_compile_and_read_their_rows() -> None:
    """take_rows on booleans computed in the same kernel (generative-recommenders' action bits), padded for a side
    that may be empty: Inductor's C++ compiles it (a padded boolean directly does not, in torch 2.13) and the rows
    are the eager ones, the padded row False."""

    def rows(weights: torch.Tensor, bits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return take_rows(((weights.unsqueeze(-1) & bits) > 0).unsqueeze(1), positions, True)

    g = torch.Generator().manual_seed(2)
    weights, bits = torch.randint(0, 16, (37,), generator=g), torch.tensor([1, 2, 4, 8])
    positions = torch.randint(0, 40, (50,), generator=g)
    got = torch.compile(rows, dynamic=True)(weights, bits, positions)
    assert got.dtype == torch.bool and got.equal(rows(weights, bits, positions))
    assert not got[positions >= 37].any() and got[positions < 37].equal(rows(weights, bits, positions.clamp(max=36))[positions < 37])


def test_jagged_concatenations_and_splits_written_as_gathers_give_the_ops_rows() -> None:
    """gathered_jagged: a derived program's jagged concatenation and split, written as gathers by search
    (concat_by_search, split_by_search), give the reference ops' rows bit for bit, with empty sides and empty users,
    on rows of one value and of many; the program's graph then holds neither op, and a split's side nothing reads is
    gone."""
    g = torch.Generator().manual_seed(3)
    for lengths_left, lengths_right in (([3, 0, 4, 1], [2, 1, 2, 0]), ([0, 0], [2, 1]), ([2, 5], [0, 0]), ([], [])):
        left_offsets = torch.tensor([0, *lengths_left]).cumsum(0)
        right_offsets = torch.tensor([0, *lengths_right]).cumsum(0)
        for rest in ((), (1,), (3, 2)):
            left = torch.randint(-9, 9, (sum(lengths_left), *rest), generator=g)
            right = torch.randint(-9, 9, (sum(lengths_right), *rest), generator=g)
            joined = concat_2D_jagged_reference(left, left_offsets, right, right_offsets)
            assert concat_by_search(left, left_offsets, right, right_offsets).equal(joined)
            got = split_by_search(joined, left_offsets, right_offsets, left.shape[0], right.shape[0])
            assert got[0].equal(left) and got[1].equal(right)

    class Jagged(torch.nn.Module):
        def forward(self, a: torch.Tensor, oa: torch.Tensor, b: torch.Tensor, ob: torch.Tensor) -> torch.Tensor:
            joined = torch.ops.hstu_export.concat_2D_jagged.default(a, oa, b, ob)
            _, right = torch.ops.hstu_export.split_2D_jagged.default(joined * 2, oa, ob, a.shape[0], b.shape[0])
            return right

    gm = gathered_jagged(torch.fx.symbolic_trace(Jagged()))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert concat_by_search in targets and split_by_search in targets
    assert not any("jagged" in str(t) and "hstu_export." in str(t) for t in targets), targets
    oa, ob = torch.tensor([0, 3, 3, 7]), torch.tensor([0, 2, 3, 5])
    a, b = torch.randn(7, 4, generator=g), torch.randn(5, 4, generator=g)
    assert gm(a, oa, b, ob).equal(2 * b)


def test_rows_gathered_from_the_rows_computed_equal_a_gather_of_the_rows_put_back() -> None:
    """rows_at: the rows a gather after the layers reads, taken from the rows computed, as rows_back then the gather
    give them (rows not computed read the fill, a negative index counts from the end); jagged_right_rows: where
    split_2D_jagged's right rows sit."""
    g = torch.Generator().manual_seed(0)
    like = torch.zeros(11, 1)
    computed = torch.tensor([1, 4, 5, 6, 9, 10])
    new = torch.randn(6, 3, 2, generator=g)
    wanted = torch.tensor([10, 0, 4, 4, -1, -7, 2, 9])
    for fill in (0.0, float("nan")):
        torch.testing.assert_close(rows_at(new, computed, like, wanted, fill), rows_back(new, computed, like, fill)[wanted],
                                   equal_nan=True)
    assert rows_at(new, computed, like, wanted[:0], 0.0).shape == (0, 3, 2)
    left, right = torch.tensor([0, 3, 3, 7]), torch.tensor([0, 2, 3, 5])
    values = torch.arange(12.0).unsqueeze(1)
    _, want = split_2D_jagged_reference(values, left, right, 7, 5)
    assert values[jagged_right_rows(left, right, 5)].equal(want)


@pytest.mark.parametrize("make", [dlrm_setup, gr_setup], ids=["dlrm_hstu", "gr_style"])
def test_the_heads_gather_their_rows_from_the_rows_computed(make: Callable[..., Setup]) -> None:
    """The heads' gather of the candidates' rows (a user function indexing the layers' output) reads the rows the
    last layer computed: no value of every row is put back; answers unchanged (the other tests)."""
    setup = make()
    derived = derive_delta(setup.result.dense, setup.example)
    called = [n.target for n in derived.program.graph.nodes if n.op == "call_function"]
    assert rows_at in called and rows_back not in called
    whole = derive_delta(setup.result.dense, setup.example, fill=float("nan"))  # every unread row NaN: none is read
    out, _ = _prefill(setup, whole)
    want = setup.result.dense(**setup.example)
    for k in want:
        torch.testing.assert_close(out[k], want[k], rtol=1e-5, atol=1e-6)


class _Rows(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.rows: dict[str, int] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and out.dim():
            self.rows[n.name] = out.shape[0]
        return out


def _prefill(setup: Setup, derived: Any) -> tuple[dict[str, torch.Tensor], _Rows]:
    d = derived
    inputs = nothing_cached(d.counts, setup.example, (d.num_layers, d.num_heads, d.attention_dim, d.linear_dim,
                                                      torch.float32), (d.row_width, d.row_dtype))
    rows = _Rows(d.program)
    with torch.no_grad():
        out = rows.run(*[inputs[n.target] for n in d.program.graph.nodes if n.op == "placeholder"])
    return out, rows


@pytest.mark.parametrize("make", [dlrm_setup, gr_setup], ids=["dlrm_hstu", "gr_style"])
def test_the_last_layer_past_its_projection_runs_on_the_targets_rows(make: Callable[..., Setup]) -> None:
    """The heads read the candidates' rows of the last layer only: past its projection, the last layer computes
    those alone (the rows of its output product are the targets'), the others' as before; answers unchanged."""
    setup = make()
    derived = derive_delta(setup.result.dense, setup.example)
    assert derived.targets_only
    assert TARGET_ROWS in [n.target for n in derived.program.graph.nodes if n.op == "placeholder"]
    out, rows = _prefill(setup, derived)
    lengths, targets = derived.counts(**{n: setup.example[n] for n in
                                         [n.target for n in derived.counts.graph.nodes if n.op == "placeholder"]})
    assert rows.rows["layers_0_out"] == int(lengths.sum())
    assert rows.rows["layers_1_out"] == int(targets.sum()) < int(lengths.sum())
    want = setup.result.dense(**setup.example)
    for k in want:
        torch.testing.assert_close(out[k], want[k], rtol=1e-5, atol=1e-6)
    whole = derive_delta(setup.result.dense, setup.example, targets_only=False)
    assert not whole.targets_only and _prefill(setup, whole)[1].rows["layers_1_out"] == int(lengths.sum())


def test_a_model_whose_outputs_read_another_row_of_its_last_layer_keeps_the_whole_layer() -> None:
    """An output that reads a history row of the last layer (here: each batch's first row) would read a row the
    targets-only layer leaves out: the derivation finds that on its example and keeps the whole layer."""
    setup = gr_setup()
    dense, values = _without_dtype_reads(setup.result.dense, setup.example)
    analysis = _Analysis(dense, values)
    analysis.walk()
    tail = _computed_from(analysis.attentions[-1], analysis.region)
    last = [n for n in dense.graph.nodes if n in tail][-1]
    output = next(n for n in dense.graph.nodes if n.op == "output")
    with dense.graph.inserting_before(output):
        first = dense.graph.call_function(operator.getitem, (last, slice(0, 1)))
    output.args = ({**output.args[0], "first_row": first},)
    dense.recompile()
    derived = derive_delta(dense, setup.example)
    assert not derived.targets_only
    out, _ = _prefill(setup, derived)
    want = dense(**setup.example)
    torch.testing.assert_close(out["first_row"], want["first_row"], rtol=1e-5, atol=1e-6)


def test_an_attention_read_only_for_its_dtype_is_not_a_layer() -> None:
    """A model may read a value only for its dtype (generative-recommenders casts a layer's next input to its
    attention's dtype; after fuse_stu_gate that attention is left with nothing else reading it): the derivation
    reads the dtype off the example, so that attention is neither computed nor taken for a layer."""
    from hstu_export.kv_derive import ATTENTION

    setup = gr_setup()
    gm = setup.result.dense
    before = derive_delta(gm, setup.example)
    attention = next(n for n in gm.graph.nodes if str(n.target) == ATTENTION)
    reader = next(iter(attention.users))
    with gm.graph.inserting_before(reader.next):  # in this order, after the reader
        twin = gm.graph.call_function(attention.target, attention.args, attention.kwargs)
        dtype = gm.graph.call_function(getattr, (twin, "dtype"))
        cast = gm.graph.call_method("to", (reader, dtype))
    reader.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    gm.recompile()
    after = derive_delta(gm, setup.example)
    assert after.num_layers == before.num_layers == 2
    attentions = [n for n in after.program.graph.nodes if n.op == "call_function" and "paged" in str(n.target)]
    assert len(attentions) == 2, attentions
    request = setup.request([gr_user(1, 8, 2), gr_user(2, 3, 1)])
    ranker = DerivedCachedRanker(EagerDerived(setup.dense_inputs, after), budget_bytes="4MiB", page_size=16)
    for _ in range(2):
        got, want = ranker(request, [1, 2]), setup.full(request)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert ranker.cache.stats()["hits"] == 2


def test_sizes_read_off_the_layers_values_and_group_norms_are_not_row_mixing() -> None:
    """TorchEasyRec builds its position encoding from the token rows' count (``x.size(0)`` of a value already in
    the layers) and normalises each row by groups (``F.group_norm`` over rows of [heads, dim]): a size read is
    not a value read, so the encoding stays before the layers (read off the request's rows), and a group norm is
    row-local. Both inserted into gr_style's graph: derived, served, the model's answers."""
    from hstu_export.kv_derive import ATTENTION

    setup = gr_setup()
    gm = setup.result.dense
    layers = derive_delta(gm, setup.example).num_layers
    frontier = next(n for n in gm.graph.nodes if n.name == derive_delta(gm, setup.example).frontier[0])
    first = next(iter(frontier.users))  # a layer value, before the first attention
    assert str(first.target) != ATTENTION
    with gm.graph.inserting_before(first.next):
        rows = gm.graph.call_method("size", (first, 0))
        encoding = gm.graph.call_function(torch.zeros, (rows, 1))  # computed from the count alone
        shifted = gm.graph.call_function(torch.add, (first, encoding))
        grouped = gm.graph.call_function(torch.nn.functional.group_norm,
                                         (gm.graph.call_method("reshape", (shifted, rows, 2, -1)), 2))
        back = gm.graph.call_method("reshape", (grouped, rows, -1))
        kept = gm.graph.call_function(torch.add, (shifted, gm.graph.call_function(torch.mul, (back, 0.0))))
    first.replace_all_uses_with(kept, delete_user_cb=lambda user: user not in (rows, shifted))
    gm.recompile()
    derived = derive_delta(gm, setup.example)
    assert derived.num_layers == layers and "zeros" in derived.frontier, derived.frontier
    ranker = DerivedCachedRanker(EagerDerived(setup.dense_inputs, derived), budget_bytes="4MiB", page_size=16)
    for users in ([gr_user(1, 8, 2), gr_user(2, 3, 1)], [gr_user(1, 8, 2), gr_user(2, 3, 1)]):
        request = setup.request(users)
        got, want = ranker(request, [1, 2]), setup.full(request)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert ranker.cache.stats()["hits"] == 2


def test_a_table_looked_up_by_index_select_runs_in_the_layers() -> None:
    """A position table read with ``index_select`` by per-row indices (as generative-recommenders' encodings are,
    once mapped onto the jagged rows) is a lookup like ``F.embedding``: the frontier holds the integer positions,
    not the looked-up rows, and the lookup runs in the layers. Inserted into gr_style's graph: served, the
    model's answers."""
    from hstu_export.kv_derive import ATTENTION

    setup = gr_setup()
    gm = setup.result.dense
    before = derive_delta(gm, setup.example)
    frontier = next(n for n in gm.graph.nodes if n.name == before.frontier[0])
    first = next(iter(frontier.users))
    offsets = next(n for n in gm.graph.nodes if str(n.target) == ATTENTION).args[3]
    assert len(before.frontier) == 1  # the token rows, as wide as the layers' rows
    gm.register_parameter("position_table", torch.nn.Parameter(torch.randn(4, before.row_width)))
    with gm.graph.inserting_before(first.next):
        rows = gm.graph.call_method("size", (first, 0))
        positions = gm.graph.call_function(operator.getitem, (
            gm.graph.call_function(torch.ops.hstu_export.jagged_positions.default, (offsets, rows)), 1))
        # Capped at the table's last row, read off the table (a size read of a parameter before the frontier).
        table = gm.graph.get_attr("position_table")
        last = gm.graph.call_function(operator.sub, (gm.graph.call_method("size", (table, 0)), 1))
        capped = gm.graph.call_function(torch.clamp, (positions,), {"max": last})
        shifted = gm.graph.call_function(torch.add, (first, gm.graph.call_function(torch.index_select,
                                                                                   (table, 0, capped))))
    first.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not shifted and user is not rows)
    gm.recompile()
    derived = derive_delta(gm, setup.example)
    assert not any(name.startswith("index_select") for name in derived.frontier), derived.frontier
    assert derived.row_width == before.row_width + 2, (before.frontier, derived.frontier)  # int64: 2 fp32 lanes
    ranker = DerivedCachedRanker(EagerDerived(setup.dense_inputs, derived), budget_bytes="4MiB", page_size=16)
    for _ in range(2):
        request = setup.request([gr_user(1, 8, 2), gr_user(2, 3, 1)])
        got, want = ranker(request, [1, 2]), setup.full(request)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    assert ranker.cache.stats()["hits"] == 2


def test_an_attention_scaled_by_the_batch_is_refused() -> None:
    setup = gr_setup(attention_scale="batch")
    with pytest.raises(ConfigError, match="--attention-scale fixed:N"):
        derive_delta(setup.result.dense, setup.example)


def test_layers_that_read_a_value_of_the_batch_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer that scales its rows by the batch's mean reads other users' tokens: not cacheable."""
    original = dlrm_hstu.STULayer.forward

    def forward(self: dlrm_hstu.STULayer, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return original(self, x * x.mean(), *args, **kwargs)

    monkeypatch.setattr(dlrm_hstu.STULayer, "forward", forward)
    setup = dlrm_setup()
    with pytest.raises(ConfigError, match="computed from the whole batch|mixes token rows"):
        derive_delta(setup.result.dense, setup.example)


# ---- through an export --------------------------------------------------------------------------------


def _cacheable_bundle(path: Path, build: str = "build_cacheable_ranker") -> Path:
    import hstu_export

    model = getattr(gr_style, build)()
    return hstu_export.save_bundle(model, path, example_inputs=gr_style.example_inputs([10, 5, 7], [3, 1, 2]),
                                   factory=f"user_models.gr_style:{build}", ranges=gr_style.RANGES)


def test_a_model_whose_attention_scale_follows_the_batch_is_refused_before_compiling(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    from hstu_export.cli import main as cli_main

    bundle = _cacheable_bundle(tmp_path / "gr.pt", build="build_ranker")
    out = tmp_path / "out"
    assert cli_main([str(bundle), "--kv-cache", "--map-function", f"{gr_style.ATTENTION}={GR_ATTENTION}",
                     "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --kv-cache: attention ") and "--attention-scale fixed:N" in err[-1]
    assert "compile" not in "".join(err)  # refused before the programs were compiled
    assert not out.exists()


@pytest.fixture(scope="module")
def derived_package(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """gr_style with a fixed attention length exported with --kv-cache (aoti, CPU, the sparse half's prechecked
    model, so that the delta program holds the sparse half), verified through its cache at export: the
    ExportResult."""
    import hstu_export

    work = tmp_path_factory.mktemp("derived")
    bundle = _cacheable_bundle(work / "grc.pt")
    return hstu_export.export(bundle, work / "pkg", hstu_export.ExportSettings(
        backend="aoti", kv_cache=True, max_batch_size=4, op_mappings={gr_style.ATTENTION: GR_ATTENTION},
        prechecked_sparse="on"))  # as on CUDA: the delta program holds the sparse half


def _script() -> list[tuple[list[int], list[User]]]:
    """(user ids, users) in serving order: a prefill, hits reordered, new candidates, a grown history (a hit:
    gr_style's rows before the layers do not change when items follow), a history changed in place under a
    cached user's id (stale: its frontier rows differ, so it runs again from nothing), the same user twice, a
    new user beside a cached one whose history is the one before the change (stale again)."""
    a, b, c = gr_user(1, 8, 3), gr_user(2, 4, 1), gr_user(3, 6, 2)
    changed = {**b, "uih_item_id": [(item + 1) % gr_style.ITEMS for item in b["uih_item_id"]]}
    return [([1, 2], [a, b]), ([2, 1], [b, a]), ([1, 2], [new_candidates(a, 5, ["cand_item_id"]), b]),
            ([1], [grown(a, gr_style.UIH_KEYS)]), ([2], [changed]), ([2, 2], [b, b]), ([3, 2], [c, b])]


def _package_request(predictor: Any, users: list[User]) -> dict[str, torch.Tensor]:
    kjts = [KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat([torch.tensor(u[k], dtype=torch.int64) for k in keys for u in users]),
        lengths=torch.tensor([len(u[k]) for k in keys for u in users]))
        for keys in (gr_style.UIH_KEYS, gr_style.CANDIDATE_KEYS)]
    return flatten_example(predictor.input_schema, tuple(kjts), None, gr_style.build_cacheable_ranker())


@pytest.mark.slow
def test_a_user_model_exports_with_its_derived_delta_program_and_serves_through_it(
        derived_package: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Every answer served through the package's cache equals the package's without the cache; the export's
    summary says what the derivation found (no fused layer on the CPU's aten target)."""
    import hstu_export
    from hstu_export.cli import _print_summary

    section, parity = derived_package.manifest["kv_cache"], derived_package.parity["kv_cache"]
    assert section["kind"] == "derived" and section["layout"]["num_layers"] == 2
    assert section["fused"] == {"gated_attention": 0, "last_layer_on_targets": True, "residual_norms": 0}
    _print_summary(derived_package.manifest, derived_package.path)
    summary = " ".join(capsys.readouterr().out.split())
    assert (f"derived from the graph: 2 layers (0 with the attention and gate as one op, the last on the targets' rows "
            f"past its projection), frontier rows of {section['layout']['row_width']} values, counts added up on the "
            f"host from the request's lengths") in summary, summary
    # The derivation reads nothing the model's graph does not: the three reads are gr_style's own jagged_concat's
    # (int(n.sum().item()) for each part); its sums, maxima and checks outside it are sizes or proven.
    reads = derived_package.manifest["backend"]["meta"]["dense_device_reads"]
    assert section["device_reads"] == reads == 3
    assert "device reads dense half 3, delta program 3 a call" in summary, summary
    assert section["target_inputs"] == ["candidates_features__cand_item_id__lengths"]
    lengths = ("uih_features__user_id__lengths", "uih_features__uih_item_id__lengths",
               "candidates_features__cand_item_id__lengths")
    assert section["counts_on_host"] == {"seq_lengths": {"terms": dict.fromkeys(lengths, 1), "constant": 0},
                                         "num_targets": {"terms": {lengths[2]: 1}, "constant": 0}}
    assert parity["passed"] and parity["cache"]["hits"] >= 3 and parity["cache"]["stale"] >= 1
    assert "not_checked" not in parity

    predictor = hstu_export.load(derived_package.path)
    ranker = predictor.kv_cache()
    for ids, users in _script():
        batch = _package_request(predictor, users)
        got, want = ranker(batch, ids), predictor(batch)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        # The counts added up on the host from the request are the counts program's.
        dense = ranker.runner.dense_inputs(batch)
        on_host = ranker.runner.counts(dense, batch)
        program = ranker.runner._counts(**{name: dense[name] for name in section["counts_inputs"]})
        assert all(torch.equal(a, b) for a, b in zip(on_host, program, strict=True))
    stats = ranker.cache.stats()
    # User 2 twice in a batch is served without being stored; only the changed history and the one after it are
    # stale (the batches differ in shape and order from request to request, which changes the rows' bits but not
    # their values).
    assert (stats["misses"], stats["hits"], stats["stale"], stats["bypassed"]) == (3, 5, 2, 2), stats

    # Its program reads sizes back from the device, so it is never replayed from a CUDA graph; on a program that
    # reads none, the graphs' bookkeeping (kept without CUDA here) answers as the program does (without shape
    # buckets: a graph per exact shape).
    with pytest.raises(ConfigError, match="reads 3 value.s. back from the device, so it cannot be replayed"):
        predictor.kv_cache(cuda_graphs=True)
    ranker = predictor.kv_cache(shape_buckets=False)
    assert ranker.runner.graphs is None
    ranker.runner.graphs = ShapeGraphs(ranker.runner._call, ranker.runner.STATIC_INPUTS, capture=False)
    counts, before = ranker.runner.graphs.counts, 0
    for k, (ids, users) in enumerate(_script() + [_script()[-1]] * 3):  # the last again: hits, of the same shapes
        before = counts["replays"] if k == len(_script()) else before
        batch = _package_request(predictor, users)
        got, want = ranker(batch, ids), predictor(batch)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert counts["replays"] - before == 2, counts  # the repeats: seen, then captured and replayed twice


def _history(user: User, items: int) -> User:
    """``user`` with ``items`` more history items (in the package's ranges), as a grown history is."""
    more = [(user["uih_item_id"][-1] + 1 + i) % gr_style.ITEMS for i in range(items)]
    return {**user, "uih_item_id": user["uih_item_id"] + more, "uih_action": user["uih_action"] + [1] * items}


_CANDIDATE_ROWS = "candidates_features.cand_item_id.values"


@pytest.mark.slow
def test_a_padding_user_puts_histories_of_other_lengths_in_one_shape_bucket(derived_package: Any, cpp_runtime: Any,
                                                                           tmp_path: Path) -> None:
    """The export read off which input each output's rows follow, and served its verification requests with a
    padding user; a history grown by 1, 2, 1 and 1 items (four shapes without it) runs in one bucket, which the
    graphs' bookkeeping replays, every answer equal to the package's without the cache; the C++ runtime pads the
    same way, bit for bit."""
    import hstu_export

    section, parity = derived_package.manifest["kv_cache"], derived_package.parity["kv_cache"]
    assert section["padding"] == {"rows_of": {"click": _CANDIDATE_ROWS, "watch": _CANDIDATE_ROWS,
                                              "kv_stale": "uih_features.user_id.lengths"}}
    assert parity["padding"]["passed"] and parity["padding"]["padded"] == 6, parity["padding"]
    predictor = hstu_export.load(derived_package.path)
    a, b = gr_user(1, 3, 2), gr_user(2, 4, 1)
    script = [([1, 2], [a, b])]
    for items in [1, 2, 1, 1]:  # 8 to 12 history items: padded to 18 (a step of 6, at least 6 of its own)
        a = _history(a, items)
        script.append(([1, 2], [a, b]))

    def served(shape_buckets: bool) -> tuple[dict[str, int], int, int]:
        ranker = predictor.kv_cache(shape_buckets=shape_buckets)
        ranker.runner.graphs = graphs = ShapeGraphs(ranker.runner._call, ranker.runner.STATIC_INPUTS, capture=False)
        for ids, users in script:
            batch = _package_request(predictor, users)
            got, want = ranker(batch, ids), predictor(batch)
            assert set(got) == set(want)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        return graphs.counts, ranker.padded_calls, ranker.cache.stats()["hits"]

    counts, padded, hits = served(True)
    # The prefill's shape, then one bucket for the four grown histories: seen, then replayed three times.
    assert (counts["replays"], counts["eager"], padded, hits) == (3, 2, 5, 8), counts
    counts, padded, hits = served(False)
    assert (counts["replays"], padded, hits) == (0, 0, 8), counts
    # The C++ runtime pads as Python does (--kv-graphs buckets: its graphs' bookkeeping without CUDA, and with it
    # the shape buckets): the same answers bit for bit, the same replays; --kv-shape-buckets off, none.
    for buckets, replays in (("auto", 3), ("off", 0)):
        ranker = predictor.kv_cache(shape_buckets=buckets == "auto")
        ranker.runner.graphs = ShapeGraphs(ranker.runner._call, ranker.runner.STATIC_INPUTS, capture=False)
        done = _served_alike(derived_package.path, predictor, ranker, script, cpp_runtime, tmp_path / buckets,
                             "--kv-graphs", "buckets", "--kv-shape-buckets", buckets)
        assert f"exact shapes: {replays} replays, 0 graphs captured" in done.stdout, done.stdout
        assert ("; a padding user in 5 calls" in done.stdout) == (buckets == "auto"), done.stdout


def test_the_padding_user_takes_each_total_to_a_step_within_its_range(derived_package: Any) -> None:
    """RequestPadding.pad on gr_style's schema (histories of at most 12 items: a step of 6; at most 5 candidates:
    a step of 5): each total lands on its step, the padding user's rows are the request's first rows, its per-user
    feature the first user's; the cached count leaves its new rows on a step; a full batch is not padded."""
    import hstu_export

    predictor = hstu_export.load(derived_package.path)
    padding = predictor.kv_cache(shape_buckets=True).runner.padding
    users = [gr_user(1, 3, 2), gr_user(2, 4, 1)]
    request = predictor.check_request(_package_request(predictor, users))
    padded = padding.pad(request, 2)
    got = padded.request
    items, cands = "uih_features.uih_item_id", "candidates_features.cand_item_id"
    assert got[f"{items}.lengths"].tolist() == [3, 4, 11]  # 7 + 11 = 18, a multiple of 6 from at least 6
    assert got["uih_features.uih_action.lengths"].tolist() == [3, 4, 11]  # the same lengths (same_as)
    assert got[f"{cands}.lengths"].tolist() == [2, 1, 2]  # 3 + 2 = 5
    assert got["uih_features.user_id.lengths"].tolist() == [1, 1, 1]
    values = request[f"{items}.values"]
    assert torch.equal(got[f"{items}.values"], torch.cat([values, values[torch.arange(11) % 7]]))
    assert torch.equal(got["uih_features.user_id.values"][2:], request["uih_features.user_id.values"][:1])
    assert padded.pad_rows[_CANDIDATE_ROWS] == 2 and padded.pad_rows["uih_features.user_id.lengths"] == 1
    assert padding.new_rows_step == 8  # the fewest stored rows of a padding user: 6 items and its user id token
    # users' (sequence, stored, cached): the padding user's 1 + 11 + 2 tokens, 12 stored; 4 + 6 new rows before it
    cached = padding.cached([6, 6, 14], [4, 5, 12], [3, 0])
    assert cached == 7 and (3 + 6 + 14 - cached) % 8 == 0
    full = [gr_user(k, 3, 2) for k in range(4)]
    assert padding.pad(predictor.check_request(_package_request(predictor, full)), 4) is None  # no room: max 4


def test_the_padding_is_dropped_where_it_changes_the_answers(derived_package: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """verify_padding fails, naming the request, where the padding user's rows would be served in place of a real
    user's (its outputs cut from the front); kv_cache(shape_buckets=True) on a package without padding is refused."""
    import shutil

    from manifests import rewrite_manifest

    import hstu_export
    from hstu_export.kv_derived_export import verify_padding
    from hstu_export.serving.kv_padding import RequestPadding

    predictor = hstu_export.load(derived_package.path)
    tolerances = {"rel_l2": 1e-5, "max_abs": 1e-4}
    assert verify_padding(predictor, predictor, tolerances, seed=0)["passed"]
    cut = RequestPadding.unpad
    monkeypatch.setattr(RequestPadding, "unpad", lambda self, outputs, padded, targets: {
        name: value[value.shape[0] - got.shape[0]:] for (name, value), got in
        zip(outputs.items(), cut(self, outputs, padded, targets).values(), strict=True)})
    report = verify_padding(predictor, predictor, tolerances, seed=0)
    assert not report["passed"] and report["reason"].startswith("a padding user changes the answers: "), report
    monkeypatch.undo()
    package = tmp_path / "no-padding"
    shutil.copytree(derived_package.path, package)
    rewrite_manifest(package, lambda m: m["kv_cache"].pop("padding"))
    with pytest.raises(ConfigError, match="records no padding user"):
        hstu_export.load(package).kv_cache(shape_buckets=True)
    assert hstu_export.load(package).kv_cache().runner.padding is None


def _served_alike(package: Path, predictor: Any, ranker: Any, script: list[tuple[list[int], list[User]]],
                  cpp_runtime: Any, tmp_path: Path, *options: object) -> Any:
    """``script`` served through ``ranker`` (Python) and through hstu-export-run --kv-cache with ``options`` on
    ``package``: the C++ answers equal Python's bit for bit; the finished C++ run."""
    from hstu_export.package.tensor_dir import load_tensors, save_tensors

    args: list[object] = [package]
    expected = []
    for k, (ids, users) in enumerate(script):
        batch = _package_request(predictor, users)
        expected.append(ranker(batch, ids))
        args.append(save_tensors(batch, tmp_path / f"request{k}"))
    for ids, _ in script:
        args += ["--user-ids", ",".join(map(str, ids))]
    done = cpp_runtime.run(*args, "--kv-cache", "auto", *options, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    for k, want in enumerate(expected):
        got = load_tensors(tmp_path / "out" / str(k + 1))
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name]), (k, name)
    return done


@pytest.mark.slow
@pytest.mark.parametrize("graphs", ["auto", "buckets"])
def test_the_cpp_runtime_serves_a_derived_program_as_python_bit_for_bit(derived_package: Any, cpp_runtime: Any,
                                                                        tmp_path: Path, graphs: str) -> None:  # fmt: skip
    """hstu-export-run --kv-cache on the derived package: the same answers as Python's cache bit for bit, and
    the same counters. ``--kv-graphs buckets`` keeps the exact-shape graphs' bookkeeping without CUDA, as
    Python's ShapeGraphs(capture=False) does: the same replays (the last request three more times: seen, then
    replayed twice) and the same answers; ``on`` is refused for a program that reads values back."""
    import re

    import hstu_export

    predictor = hstu_export.load(derived_package.path)
    ranker = predictor.kv_cache()
    if graphs == "buckets":
        ranker.runner.graphs = ShapeGraphs(ranker.runner._call, ranker.runner.STATIC_INPUTS, capture=False)
    script = _script() + [_script()[-1]] * 3
    done = _served_alike(derived_package.path, predictor, ranker, script, cpp_runtime, tmp_path, "--kv-graphs", graphs)
    stats = ranker.cache.stats()
    found = re.findall(r"kv cache: (\d+) hits, (\d+) misses, (\d+) stale, (\d+) evictions, (\d+) bypassed", done.stdout)
    assert found and tuple(map(int, found[-1])) == tuple(stats[k] for k in ("hits", "misses", "stale", "evictions",
                                                                             "bypassed")), done.stdout
    if graphs == "auto":  # on the CPU: no graphs
        assert "exact shapes" not in done.stdout, done.stdout
        # With held rows (each user's jagged request rows kept; a user twice in a request neither takes nor keeps):
        # the same answers and counters, and the rows taken and sent that the rule gives.
        held = _served_alike(derived_package.path, predictor, predictor.kv_cache(), script, cpp_runtime,
                             tmp_path / "held", "--kv-graphs", graphs, "--kv-held-rows", "on")
        assert re.findall(r"kv cache: (\d+) hits, (\d+) misses, (\d+) stale, (\d+) evictions, (\d+) bypassed",
                          held.stdout)[-1] == found[-1], held.stdout
        requests = [(ids, _package_request(predictor, users)) for ids, users in script]
        counted = re.findall(r"held rows: (\d+) taken from the device, (\d+) sent", held.stdout)
        assert tuple(map(int, counted[-1])) == held_rows_of(derived_package.manifest, requests), held.stdout
        assert int(counted[-1][0]) > 0, held.stdout
        return
    counts = ranker.runner.graphs.counts
    assert counts["replays"] >= 2
    assert (f"exact shapes: {counts['replays']} replays, 0 graphs captured, {counts['eager']} run as they are"
            in done.stdout), (counts, done.stdout)
    refused = cpp_runtime.run(derived_package.path, tmp_path / "request0", "--kv-cache", "auto", "--kv-graphs", "on",
                              "--user-ids", ",".join(map(str, script[0][0])))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "reads 3 value(s) back from the device, so it cannot be replayed from a CUDA graph" in refused.stderr


@pytest.mark.slow
def test_a_whole_request_graph_holds_the_sparse_half_and_answers_the_same(cpp_runtime: Any, tmp_path: Path) -> None:
    """With the counts added up on the host and the compiled sparse half's prechecked model, nothing before the
    delta program reads the device, so the exact-shape graphs hold the whole request: their inputs are the
    request's tensors (the sparse half runs inside), not the rows it looks up. Python's and C++'s bookkeeping
    (``--kv-graphs buckets``, no CUDA) replay the same calls, padded into shape buckets alike, and answer as the cache
    without graphs (bit for bit between the runtimes; a padding user may change the last bits)."""
    import hstu_export

    bundle = _cacheable_bundle(tmp_path / "grc.pt")
    package = hstu_export.export(bundle, tmp_path / "pkg", hstu_export.ExportSettings(
        backend="aoti", kv_cache=True, max_batch_size=4, prechecked_sparse="on",
        op_mappings={gr_style.ATTENTION: GR_ATTENTION})).path
    predictor = hstu_export.load(package)
    assert predictor.split.sparse_model == "prechecked"
    plain, ranker = predictor.kv_cache(), predictor.kv_cache()
    runner = ranker.runner
    assert plain.runner.graphs is None and not plain.runner.whole_request  # on the CPU: no graphs
    runner.graphs, runner.whole_request = ShapeGraphs(runner._call, runner.STATIC_INPUTS, capture=False), True
    script = _script() + [_script()[-1]] * 3
    for ids, users in script:
        batch = _package_request(predictor, users)
        got, want = ranker(batch, ids), plain(batch, ids)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert ranker.padded_calls == len(script)  # each has room for a padding user (at most 2 of 4 users)
    looked_up = {t["name"] for t in predictor.manifest["artifacts"]["dense"]["inputs"] if not t.get("feature")}
    buffers = [set(entry.inputs) for entry in runner.graphs._graphs.values()]
    assert looked_up and buffers and all(  # the request is copied in, never the rows looked up
        any(name.startswith(runner.REQUEST_INPUT) for name in names) and not names & looked_up for names in buffers)
    counts = runner.graphs.counts
    assert counts["replays"] >= 2 and ranker.cache.stats() == plain.cache.stats()
    fresh = predictor.kv_cache()
    fresh.runner.graphs = ShapeGraphs(fresh.runner._call, fresh.runner.STATIC_INPUTS, capture=False)
    fresh.runner.whole_request = True
    done = _served_alike(package, predictor, fresh, script, cpp_runtime, tmp_path, "--kv-graphs", "buckets")
    assert fresh.runner.graphs.counts == counts
    assert (f"exact shapes: {counts['replays']} replays, 0 graphs captured, {counts['eager']} run as they are"
            in done.stdout), (counts, done.stdout)
    ids = ",".join(map(str, script[0][0]))
    timed = cpp_runtime.run(package, tmp_path / "request0", "--kv-cache", "auto", "--kv-graphs", "buckets",
                            "--user-ids", ids, "--repeat", "2", "--phase-times")
    assert timed.returncode == 0 and "(the sparse half runs in the dense half's graph)" in timed.stdout, timed.stdout


@pytest.mark.slow
def test_without_counts_on_host_the_counts_program_serves_the_same(derived_package: Any, cpp_runtime: Any,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """A package whose manifest has no ``counts_on_host`` (counts that are not sums of request features, or an
    older export) runs its counts program instead: Python and C++ answer as the package with the sums does, bit
    for bit, with the same counters."""
    import re
    import shutil

    from manifests import rewrite_manifest

    import hstu_export
    from hstu_export.package.tensor_dir import load_tensors, save_tensors

    package = tmp_path / "pkg"
    shutil.copytree(derived_package.path, package)
    rewrite_manifest(package, lambda m: m["kv_cache"].pop("counts_on_host"))
    with_sums, without = hstu_export.load(derived_package.path).kv_cache(), hstu_export.load(package).kv_cache()
    assert with_sums.runner._host_counts is not None and without.runner._host_counts is None
    args: list[object] = [package]
    answers = []
    for k, (ids, users) in enumerate(_script()):
        batch = _package_request(hstu_export.load(package), users)
        want, got = with_sums(batch, ids), without(batch, ids)
        assert all(torch.equal(got[name], want[name]) for name in want), k
        answers.append(got)
        args.append(save_tensors(batch, tmp_path / f"request{k}"))
    assert without.cache.stats() == with_sums.cache.stats()
    for ids, _ in _script():
        args += ["--user-ids", ",".join(map(str, ids))]
    done = cpp_runtime.run(*args, "--kv-cache", "auto", "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    for k, want in enumerate(answers):
        got = load_tensors(tmp_path / "out" / str(k + 1))
        assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want), k
    stats = without.cache.stats()
    found = re.findall(r"kv cache: (\d+) hits, (\d+) misses, (\d+) stale", done.stdout)
    assert found and tuple(map(int, found[-1])) == (stats["hits"], stats["misses"], stats["stale"]), done.stdout


@pytest.mark.slow
def test_calls_past_the_graph_copy_limit_run_as_they_are(derived_package: Any, cpp_runtime: Any, tmp_path: Path) -> None:
    """--kv-graph-copy-limit: with a limit below every call's copied inputs, the exact-shape bookkeeping sends every
    call to run as it is (none seen, none replayed), and the answers are Python's bit for bit; a limit that is not
    a size is refused in one line, in Python too."""
    import hstu_export

    predictor = hstu_export.load(derived_package.path)
    ranker = predictor.kv_cache()
    # The same bookkeeping in Python (kept without CUDA): every call's copies exceed the limit.
    # (Its program holds the sparse half: the copies are the request's ids and the cache's row lists, a few bytes.)
    ranker.runner.graphs = ShapeGraphs(ranker.runner._call, (*ranker.runner.STATIC_INPUTS, *ranker.runner._tables),
                                       capture=False, max_bytes=8)
    script = _script() + [_script()[-1]] * 3
    done = _served_alike(derived_package.path, predictor, ranker, script, cpp_runtime, tmp_path, "--kv-graphs",
                         "buckets", "--kv-graph-copy-limit", "8")
    counts = ranker.runner.graphs.counts
    assert counts["replays"] == 0 and counts["eager"] >= len(script)
    assert f"exact shapes: 0 replays, 0 graphs captured, {counts['eager']} run as they are" in done.stdout, done.stdout
    with pytest.raises(ConfigError, match="graph_copy_limit: cannot read size 'lots'"):
        predictor.kv_cache(graph_copy_limit="lots")


def test_a_page_size_other_than_the_programs_is_refused() -> None:
    class Exported:  # a runner whose program was exported for pages of 64 tokens
        def __init__(self) -> None:
            self.page_size, self.device, self.dtype = 64, torch.device("cpu"), torch.float32
            self.layout = {"num_layers": 1, "num_heads": 1, "attention_dim": 8, "linear_dim": 8, "row_width": 8,
                           "row_dtype": "float32"}

    with pytest.raises(ConfigError, match="reads pages of 64 tokens; use page_size=64"):
        DerivedCachedRanker(Exported(), budget_bytes="1MiB", page_size=16)  # type: ignore[arg-type]
    assert DerivedCachedRanker(Exported(), budget_bytes="1MiB", page_size=64).cache.page_size == 64  # type: ignore[arg-type]


def test_verification_requests_check_new_candidates_only_where_targets_are_counted() -> None:
    from hstu_export.kv_derived_export import GROWN, NEW_CANDIDATES, verification_requests

    schema = gr_setup().schema
    with_targets = verification_requests(schema, ["candidates_features__cand_item_id__lengths"], 4, seed=0)
    without = verification_requests(schema, [], 4, seed=0)
    assert [what for what, _, _ in with_targets if what not in {w for w, _, _ in without}] == [NEW_CANDIDATES]
    first = next(batch for what, _, batch in with_targets if what == GROWN)  # the whole histories
    _, _, fresh = next(step for step in with_targets if step[0] == NEW_CANDIDATES)
    for name in ("uih_features.uih_item_id.values", "uih_features.uih_item_id.lengths"):
        assert torch.equal(fresh[name], first[name])  # the same histories
    assert not torch.equal(fresh["candidates_features.cand_item_id.values"],
                           first["candidates_features.cand_item_id.values"])


_UNKNOWN_INPUT = "takes 'no_such_ids', which is neither a dense input, a cache input nor a sparse input fed from the request"
_UNKNOWN_TABLE = "names 'no.such.weight', which the sparse half's tables do not hold"
_SPARSE_OUTPUT = "takes 'embedding_collection__uih_item_id__values', an output of the sparse half, which the program holds (kv_cache.sparse_inside)"
# Damaged kv_cache sections that both runtimes refuse with the same words.
_REFUSED_BY_BOTH = [
    (lambda kv: kv["inputs"].insert(0, "no_such_ids"), _UNKNOWN_INPUT),
    (lambda kv: kv["sparse_inside"]["tables"].update(kv_table_0="no.such.weight"), _UNKNOWN_TABLE),
    (lambda kv: kv["inputs"].insert(0, "embedding_collection__uih_item_id__values"), _SPARSE_OUTPUT),
]
_ROWS_OF = "is not an object naming, for each output, the request feature or cache input whose rows it follows"
_REFUSED_BY_BOTH += [(lambda kv: kv["padding"]["rows_of"].update(click="no_such_rows"), _ROWS_OF),
                     (lambda kv: kv["padding"]["rows_of"].pop("kv_stale"), _ROWS_OF)]
_REFUSED_IDS = ["unknown-input", "unknown-table", "sparse-output", "padding-unknown-rows", "padding-missing-output"]


@pytest.mark.parametrize("edit, message", _REFUSED_BY_BOTH, ids=_REFUSED_IDS)
def test_a_damaged_derived_section_is_refused_at_load(derived_package: Any, tmp_path: Path, edit: Any,
                                                      message: str) -> None:
    """A delta program input that is no dense input, cache input or request input, a table the sparse half does
    not hold, or an output of the sparse half the program holds: Python's kv_cache() is refused in one line naming
    it (the C++ runtime's refusal is below)."""
    import shutil

    from manifests import rewrite_manifest

    import hstu_export
    from hstu_export.errors import PackageError

    package = tmp_path / "pkg"
    shutil.copytree(derived_package.path, package)
    rewrite_manifest(package, lambda m: edit(m["kv_cache"]))
    with pytest.raises(PackageError, match=re.escape(message)) as caught:
        hstu_export.load(package).kv_cache()
    assert "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize("edit, message", [
    (lambda kv: kv.update(counts=kv.pop("counts_program")), "torch.export counts program of an older hstu-export"),
    (lambda kv: kv["inputs"].remove("kv_x_pages"), "lacks 'kv_x_pages'"),
    (lambda kv: kv["outputs"].remove("kv_stale"), "does not end with kv_stale"),
    (lambda kv: kv["layout"].update(row_dtype="int64"), "'kv_cache.layout.row_dtype' is 'int64'"),
    (lambda kv: kv["counts_on_host"]["seq_lengths"]["terms"].update(kv_cached=1),
     "'kv_cache.counts_on_host.seq_lengths.terms' names 'kv_cached', which is not a counts input fed from the request"),
    *_REFUSED_BY_BOTH,
], ids=["old-counts", "no-x-pages", "no-stale", "row-dtype", "host-counts", *_REFUSED_IDS])
def test_the_cpp_runtime_refuses_a_damaged_derived_section_in_one_line(derived_package: Any, cpp_runtime: Any,
                                                                       tmp_path: Path, edit: Any, message: str) -> None:  # fmt: skip
    """--kv-cache refused in one line naming the field; the package still serves requests without a cache."""
    import shutil

    from manifests import rewrite_manifest

    import hstu_export
    from hstu_export.package.tensor_dir import save_tensors

    package = tmp_path / "pkg"
    shutil.copytree(derived_package.path, package)
    rewrite_manifest(package, lambda m: edit(m["kv_cache"]))
    ids, users = _script()[0]
    request = save_tensors(_package_request(hstu_export.load(derived_package.path), users), tmp_path / "request")
    done = cpp_runtime.run(package, request, "--kv-cache", "auto", "--user-ids", ",".join(map(str, ids)))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("hstu-export-run: error: ") and message in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1
    assert cpp_runtime.run(package, request, "-q").returncode == 0


def test_with_contextual_rows_that_see_the_history_a_grown_history_is_stale() -> None:
    """delta_rows with ``whole_history`` (an attention's contextual rows see every history row): a user whose
    whole history is cached is not stale; one whose history grew past its cached prefix is, though its cached
    rows are unchanged; without the flag it is a hit."""
    lengths, targets = torch.tensor([6, 6]), torch.tensor([2, 2])  # 4 history rows and 2 candidates each
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.arange(12, dtype=torch.float32).reshape(12, 1).repeat(1, 3)
    pages, table = torch.zeros(5, 4, 3), torch.arange(4, dtype=torch.int32).reshape(2, 2)
    _delta(offsets, targets, torch.zeros(2, dtype=torch.int64), [rows], pages, table)  # stores the rows
    cached = torch.tensor([4, 3])  # user 0: its whole history; user 1: all but its last history row
    assert _delta(offsets, targets, cached, [rows], pages.clone(), table, True)[4].tolist() == [False, True]
    assert _delta(offsets, targets, cached, [rows], pages.clone(), table)[4].tolist() == [False, False]


def test_verification_grows_each_history_by_a_token() -> None:
    """The derived program's verification first serves every history a token shorter, then whole: the grown
    step keeps the candidates and each user's earlier history tokens as they were."""
    from hstu_export.kv_derived_export import GROWN, verification_requests

    schema = gr_setup().schema
    steps = verification_requests(schema, ["candidates_features__cand_item_id__lengths"], 4, seed=0)
    (first_what, _, shorter), (grown_what, _, whole) = steps[:2]
    assert first_what.startswith("prefill") and grown_what == GROWN
    lengths, values = "uih_features.uih_item_id.lengths", "uih_features.uih_item_id.values"
    assert torch.equal(shorter[lengths], torch.clamp(whole[lengths] - 1, min=1))
    ends = whole[lengths].cumsum(0)
    keep = torch.cat([torch.arange(int(end - n), int(end - n + m)) for end, n, m in
                      zip(ends, whole[lengths], shorter[lengths], strict=True)])
    assert torch.equal(shorter[values], whole[values][keep])
    for name in ("candidates_features.cand_item_id.values", "candidates_features.cand_item_id.lengths"):
        assert torch.equal(shorter[name], whole[name])


def test_a_gated_attention_is_written_as_the_attention_and_its_gate() -> None:
    """ungate: hstu_mha_gated (the zoo's STU layer between its projections) becomes one hstu_mha node and
    row-local ops, with the same numbers."""
    from hstu_export.kv_derive import ATTENTION, GATED, ungate
    from hstu_export.ops import library  # noqa: F401  (registers the ops)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.rand(8) + 0.5), torch.nn.Parameter(torch.rand(8))

        def forward(self, uvqk: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
            return torch.ops.hstu_export.hstu_mha_gated(uvqk, offsets, self.weight, self.bias, 2, 4, 4, 16, 16, 0.5,
                                                        True, None, 1, 0, 1e-6)

    torch.manual_seed(0)
    uvqk, offsets = torch.randn(9, 2 * (2 * 4 + 2 * 4)), torch.tensor([0, 5, 9])
    gm = torch.fx.symbolic_trace(Layer())
    want = gm(uvqk, offsets)
    ungate(gm)
    gm.recompile()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert GATED not in targets and targets.count(ATTENTION) == 1
    torch.testing.assert_close(gm(uvqk, offsets), want, rtol=1e-5, atol=1e-6)


class _Zoo:
    """The zoo's tiny preset captured as an export does with ``--kv-cache --kv-program derived`` (the attention as
    our op with its CPU kernel), before its delta program is derived."""

    def __init__(self, tmp_path: Path, dtype: str) -> None:
        import hstu_export
        from hstu_export.exporter import _compile_inputs, capture
        from hstu_export.models import build_preset

        self.model = build_preset("tiny", seed=0)
        self.schema = self.model.input_schema()
        bundle = hstu_export.load_bundle(hstu_export.save_bundle(self.model, tmp_path / "zoo.pt",
                                                                 hstu_export.generate_batch(self.schema, 2, seed=1)))
        settings = hstu_export.ExportSettings(backend="aoti", kv_cache=True, kv_program="derived", dtype=dtype,
                                              max_batch_size=4, skip_passes=("fuse_stu_gate",))
        with torch.no_grad():
            self.captured = capture(bundle, settings, "triton")
            self.result = on_the_cpu(self.captured.result)
            self.inputs = _compile_inputs(self.result, self.captured.schema.to_graph_inputs(self.captured.example),
                                          self.captured.schema, self.captured.ranges, settings)

    def derive(self) -> Any:
        from hstu_export.kv_derived_export import derive_for_export

        with torch.no_grad():
            return derive_for_export(self.result, self.inputs, "aten")  # lowered to the target that runs here

    def request_inputs(self, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The request's features and the dense inputs (a program comparing ids takes both)."""
        graph = self.captured.schema.to_graph_inputs(request)
        sparse = self.result.sparse(**{t.name: graph[t.name] for t in self.result.boundary.sparse_inputs})
        return {**graph, **{t.name: sparse[t.name] if t.source == "sparse" else graph[t.name]
                            for t in self.result.boundary.dense_inputs}}

    def full(self, request: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dense = self.request_inputs(request)
        with torch.no_grad():
            return self.result.dense(**{n: dense[n] for n in self.inputs.dense_input_names})

    def requests(self) -> list[dict[str, torch.Tensor]]:
        """Two users, then the same histories with new candidates."""
        import hstu_export

        lengths = {"uih_lengths": [12, 9]}
        whole = hstu_export.generate_batch(self.schema, 2, seed=11, lengths={**lengths, "candidate_lengths": [3, 2]})
        again = hstu_export.generate_batch(self.schema, 2, seed=12, lengths={**lengths, "candidate_lengths": [2, 4]})
        return [whole, {**again, **{k: v for k, v in whole.items()
                                    if k.startswith("uih_") or k in ("query_time", "user_id", "user_age")}}]


def test_the_zoo_model_in_bf16_derives_through_its_casts(tmp_path: Path) -> None:
    """A bf16 export casts each layer's input to its weights' dtype (follow_parameter_dtypes' ``to_dtype_of``):
    the derivation reads those casts as row-local, and the derived program answers a first request and the same
    histories with new candidates (hits) as the dense half does, in bf16."""
    zoo = _Zoo(tmp_path, "bf16")
    derived = zoo.derive()
    casts = [n for n in derived.program.graph.nodes if n.op == "call_function" and n.target.__name__ == "to_dtype_of"]
    assert casts, "a bf16 dense half has casts before its layers"
    # The position and time-bucket lookups run in the layers: the frontier holds their indices, not the looked-up
    # rows. The projections before the jagged concatenations run there too: the frontier holds the embeddings they
    # project, cast to bf16, and which side of each concatenation a row is from.
    lookups = [n for n in derived.program.graph.nodes if n.op == "call_function" and n.target is F.embedding]
    assert len(lookups) == 2 and all(n.args[0].target is torch.index_select for n in lookups), lookups
    assert not any(name.startswith("concat") for name in derived.frontier), derived.frontier
    # The embeddings are compared as the ids the sparse half looked them up from; the contextual rows (each user's
    # two, projected from its id and age embeddings) as the user's two ids and the row's place among its two.
    assert derived.compared_ids == {"to": ["uih_item_ids"], "to_1": ["uih_action_ids"], "to_2": ["candidate_item_ids"],
                                    "flatten": [{"ids": ["user_id", "user_age"], "rows_each": 2}]}, derived.compared_ids
    assert derived.key_inputs == ["uih_item_ids", "uih_action_ids", "candidate_item_ids", "user_id", "user_age"]
    # Nine int64 columns, two float32 lanes each: the item ids (history and candidates share them), the action ids,
    # the contextual ids and place, the position and time bucket, and the two concatenations' sides. The
    # embeddings' rows were 2 x 32 bf16 columns of these (a kilobyte at the dlrmv3 preset's 512).
    assert (derived.row_width, derived.row_dtype) == (9 * 2, torch.float32), (derived.frontier, derived.row_width)
    # The embeddings' rows are dense inputs the ranges never leave empty: the layers read them without a copy; the
    # contextual rows, computed in the graph, through a zero row.
    reads = {n.args[0].name: n.args[2] for n in derived.program.graph.nodes if n.target is take_rows}
    assert reads == {"to": False, "to_1": False, "to_2": False, "flatten": True}, reads
    projected: list[int] = []  # the rows each call's history projection computes
    derived.program.get_submodule("transducer.preprocessor.history_proj").register_forward_hook(
        lambda m, args, out: projected.append(out.shape[0]))

    ranker = DerivedCachedRanker(EagerDerived(zoo.request_inputs, derived, dtype=torch.bfloat16),
                                 budget_bytes="4MiB", page_size=16)
    for request in zoo.requests():
        with torch.no_grad():
            got, want = ranker(request, [1, 2]), zoo.full(request)
        for name in want:
            assert got[name].dtype == torch.bfloat16
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=2e-2, atol=2e-2)
    assert ranker.cache.stats()["hits"] == 2, ranker.cache.stats()
    # Per request the program's call, then the dense half's (the module is shared): the hit projects the new
    # candidates' rows alone, where the dense half projects every history row.
    assert projected == [30, 21, 2 + 4, 21], projected


def _with_neighbour(rows: torch.Tensor) -> torch.Tensor:
    """Each user's two contextual rows plus the user's before it (a row reading another user's)."""
    return rows + 0.5 * rows.roll(2, 0)


def _with_place(rows: torch.Tensor) -> torch.Tensor:
    """The contextual rows plus their place in the batch (a row reading its user's position)."""
    return rows + 0.5 * torch.arange(rows.shape[0], dtype=rows.dtype).unsqueeze(1)


def _with_batch_size(rows: torch.Tensor) -> torch.Tensor:
    """The contextual rows plus the batch's size (a row reading no other row, yet not its user's alone)."""
    return rows + 0.25 * rows.shape[0]


@pytest.mark.parametrize("change, stats", [(None, (3, 4, 0)), (_with_neighbour, (3, 2, 2)), (_with_place, (3, 1, 3)),
                                           (_with_batch_size, (3, 3, 1))],
                         ids=["own_user", "neighbour", "place", "batch_size"])
def test_contextual_rows_are_compared_as_their_users_ids_only_where_made_from_them_alone(
        tmp_path: Path, change: Any, stats: tuple[int, int, int]) -> None:
    """The zoo's contextual rows, each user's two projected from its id and age embeddings, are compared as the
    user's ids and each row's place among its two. Made to read the user before them too, their place in the
    batch or the batch's size, they are compared as the rows they are: two users reordered are then hits (the
    same neighbours, the same size) or stale (new places), a cached user beside a new one is stale where it read
    its neighbour, a user alone is stale where it read its neighbour or the size, and every answer is the
    model's."""
    import hstu_export
    from hstu_export.kv_derived_export import _users

    zoo = _Zoo(tmp_path, "fp32")
    graph = zoo.result.dense.graph
    flatten = next(n for n in graph.nodes if n.name == "flatten")
    if change is not None:
        readers = list(flatten.users)
        with graph.inserting_after(flatten):
            changed = graph.call_function(change, (flatten,))
        for reader in readers:
            reader.replace_input_with(flatten, changed)
        zoo.result.dense.recompile()
    derived = zoo.derive()
    blocks = {name: got for name, got in derived.compared_ids.items() if got and isinstance(got[0], dict)}
    assert blocks == ({"flatten": [{"ids": ["user_id", "user_age"], "rows_each": 2}]} if change is None else {}), blocks
    schema = zoo.captured.schema
    first, other = zoo.requests()[0], hstu_export.generate_batch(schema, 1, seed=21)
    reordered = {name: _users(schema, first, [1, 0], name) for name in first}
    newcomer = {name: torch.cat([_users(schema, first, [0], name), other[name]]) for name in first}
    ranker = DerivedCachedRanker(EagerDerived(zoo.request_inputs, derived), budget_bytes="4MiB", page_size=16)
    alone = {name: _users(schema, first, [0], name) for name in first}
    for ids, request in (([1, 2], first), ([2, 1], reordered), ([1, 3], newcomer), ([1], alone)):
        got, want = ranker(request, ids), zoo.full(request)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)
    c = ranker.cache.stats()
    assert (c["misses"], c["hits"], c["stale"]) == stats, c


def test_the_delta_program_choice_is_checked(tmp_path: Path) -> None:
    import hstu_export
    from hstu_export.settings import ExportSettings

    with pytest.raises(ConfigError, match="auto, written or derived"):
        ExportSettings(kv_cache=True, kv_program="by hand")
    with pytest.raises(ConfigError, match="add --kv-cache"):
        ExportSettings(kv_program="derived")
    bundle = _cacheable_bundle(tmp_path / "gr.pt")
    with pytest.raises(ConfigError, match="--kv-program written: the hand-written delta program is hstu-export's"):
        hstu_export.export(bundle, tmp_path / "pkg", ExportSettings(backend="aoti", kv_cache=True, kv_program="written"))
    assert not (tmp_path / "pkg").exists()


@pytest.mark.slow
@pytest.mark.parametrize("prechecked", ["auto", "on"], ids=["sparse_apart", "sparse_inside"])
def test_the_zoo_model_serves_through_a_derived_delta_program(cpp_runtime: Any, tmp_path: Path, prechecked: str) -> None:
    """The zoo's tiny preset exported with --kv-program derived (its gated attention read as the attention and
    its gate; its contextual rows see the whole history): verified at export, a grown history is stale, and
    every answer of its cache, in Python and C++, equals the package's without the cache. With the sparse half's
    prechecked model (on the CPU only when asked for), the program holds the sparse half: it takes the request's
    ids and the sparse half's tables, none of its outputs."""
    import hstu_export
    from hstu_export.models import build_preset
    from hstu_export.package.tensor_dir import load_tensors, save_tensors

    model = build_preset("tiny", seed=0)
    schema = model.input_schema()
    bundle = hstu_export.save_bundle(model, tmp_path / "zoo.pt", hstu_export.generate_batch(schema, 2, seed=1))
    result = hstu_export.export(bundle, tmp_path / "pkg", hstu_export.ExportSettings(
        backend="aoti", kv_cache=True, kv_program="derived", max_batch_size=4, prechecked_sparse=prechecked))
    assert result.manifest["kv_cache"]["kind"] == "derived"
    inside = result.manifest["kv_cache"].get("sparse_inside")
    boundary = set(result.manifest["sparse_output_names"])
    taken = set(result.manifest["kv_cache"]["inputs"])
    if prechecked == "on":
        tables = {t["name"] for t in result.manifest["artifacts"]["sparse"]["constants"]["tensors"]}
        assert inside is not None and set(inside["tables"].values()) == tables, inside
        assert not taken & boundary and {"uih_item_ids", "user_id"} <= taken, taken
    else:
        assert inside is None and boundary <= taken, taken
    # Each user's sequence: its 2 contextual tokens, history and candidates (a range over the users times 2 in the
    # graph), added up on the host.
    assert result.manifest["kv_cache"]["counts_on_host"] == {
        "seq_lengths": {"terms": {"candidate_lengths": 1, "uih_lengths": 1}, "constant": 2},
        "num_targets": {"terms": {"candidate_lengths": 1}, "constant": 0}}
    parity = result.parity["kv_cache"]
    assert parity["passed"] and parity["cache"]["hits"] >= 3 and parity["cache"]["stale"] >= 2
    whole = hstu_export.generate_batch(schema, 2, seed=11, lengths={"uih_lengths": [12, 9], "candidate_lengths": [3, 2]})
    keep = torch.cat([torch.arange(0, 10), torch.arange(12, 19)])  # each history without its last two tokens
    shorter = {**whole, **{k: v[keep] for k, v in whole.items() if k.startswith("uih_") and v.shape[0] == 21},
               "uih_lengths": whole["uih_lengths"] - 2}
    new_candidates = hstu_export.generate_batch(schema, 2, seed=12, lengths={"uih_lengths": [12, 9],
                                                                             "candidate_lengths": [2, 4]})
    new_candidates = {**new_candidates, **{k: v for k, v in whole.items() if k.startswith("uih_") or k in
                                           ("query_time", "user_id", "user_age")}}
    changed = {**whole, "uih_item_ids": whole["uih_item_ids"].clone()}  # the first user's 5th item, in place
    changed["uih_item_ids"][4] = whole["uih_item_ids"][6]
    assert not torch.equal(changed["uih_item_ids"], whole["uih_item_ids"])
    script = [shorter, whole, whole, new_candidates, changed, shorter]
    predictor = hstu_export.load(result.path)
    ranker = predictor.kv_cache()
    answers = []
    for k, request in enumerate(script):
        got, want = ranker(request, [1, 2]), predictor(request)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        answers.append(got)
        if k == 3:
            stats = ranker.cache.stats()
            assert (stats["misses"], stats["stale"], stats["hits"]) == (2, 2, 4), stats  # grown: stale; then hits
    stats = ranker.cache.stats()
    assert (stats["stale"], stats["hits"]) == (2 + 1 + 2, 4 + 1), stats  # the changed user, then both shorter
    # With a padding user (shape buckets, verified at export): the same answers, the same counters.
    assert parity["padding"]["passed"] and set(result.manifest["kv_cache"]["padding"]["rows_of"]) == set(want) | {
        "kv_stale"}, parity["padding"]
    padded = predictor.kv_cache(shape_buckets=True)
    padded_answers = []
    for request in script:
        got, want = padded(request, [1, 2]), predictor(request)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)
        padded_answers.append(got)
    assert padded.padded_calls == len(script) and padded.cache.stats() == stats
    args: list[object] = [result.path, *(save_tensors(r, tmp_path / f"request{k}") for k, r in enumerate(script))]
    for _ in script:
        args += ["--user-ids", "1,2"]
    # The C++ cache without held rows, and with them: each user's jagged request rows kept, the rows after an
    # unchanged prefix sent, the changed history and the shorter one sent whole.
    for held in ("off", "on"):
        done = cpp_runtime.run(*args, "--kv-cache", "auto", "--kv-held-rows", held, "--out", tmp_path / held)
        assert done.returncode == 0, done.stderr
        for k, want in enumerate(answers):
            got = load_tensors(tmp_path / held / str(k + 1))
            assert all(torch.equal(got[name], want[name]) for name in want), (held, k)
        found = re.findall(r"kv cache: (\d+) hits, (\d+) misses, (\d+) stale", done.stdout)
        assert tuple(map(int, found[-1])) == (stats["hits"], stats["misses"], stats["stale"]), done.stdout
        counted = re.findall(r"held rows: (\d+) taken from the device, (\d+) sent", done.stdout)
        if held == "off":
            assert not counted, done.stdout
        else:
            assert tuple(map(int, counted[-1])) == held_rows_of(result.manifest, [([1, 2], r) for r in script])
            assert int(counted[-1][0]) > 0, done.stdout
    # With shape buckets on, the C++ runtime pads as Python does: the same answers bit for bit.
    done = cpp_runtime.run(*args, "--kv-cache", "auto", "--kv-shape-buckets", "on", "--out", tmp_path / "padded")
    assert done.returncode == 0, done.stderr
    for k, want in enumerate(padded_answers):
        got = load_tensors(tmp_path / "padded" / str(k + 1))
        assert all(torch.equal(got[name], want[name]) for name in want), k
    # The same from Python, through the C++ runtime's library.
    from hstu_export.runtimes.native import LIBRARY_NAME, NativePredictor

    native = NativePredictor(result.path, library=cpp_runtime.path.parent / LIBRARY_NAME).kv_cache(held_rows=True)
    for k, (request, want) in enumerate(zip(script, answers, strict=True)):
        got = native(request, [1, 2])
        assert all(torch.equal(got[name], want[name]) for name in want), k
    with pytest.raises(ConfigError, match="held_rows is True or False"):
        NativePredictor(result.path, library=cpp_runtime.path.parent / LIBRARY_NAME).kv_cache(held_rows="on")
    native = NativePredictor(result.path, library=cpp_runtime.path.parent / LIBRARY_NAME).kv_cache(shape_buckets=True)
    for k, (request, want) in enumerate(zip(script, padded_answers, strict=True)):
        got = native(request, [1, 2])
        assert all(torch.equal(got[name], want[name]) for name in want), k

