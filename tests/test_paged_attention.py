"""Delta attention against a paged K/V cache (hstu_export/ops/paged.py): the PyTorch version and the
Triton kernel (CPU interpreter) equal the rows of full HSTU attention over the whole sequence, for
every kind of delta (one token, only candidates, new history plus candidates), with contextual tokens,
a local window, shuffled pages and the keys split across programs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hstu_export.ops.paged import (
    paged_attention_inputs_reference,
    paged_hstu_mha_reference,
    paged_hstu_mha_store_reference,
)
from hstu_export.ops.reference import hstu_mha_reference


def _case(q_lens: list[int], seq_lens: list[int], targets: list[int], *, heads: int = 2, dqk: int = 16,
          dv: int = 16, page_size: int = 16, dtype: torch.dtype = torch.float32, seed: int = 0):  # type: ignore[no-untyped-def]
    """Random full q/k/v per user; the last q_lens tokens of each user are the new rows, the ones before
    them are written to shuffled pages (everything else in the pages is NaN)."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    q = torch.randn(total, heads, dqk, generator=gen).to(dtype)
    k = torch.randn(total, heads, dqk, generator=gen).to(dtype)
    v = torch.randn(total, heads, dv, generator=gen).to(dtype)
    offsets = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    pages_per_user = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_user) + 3  # spare pages never referenced
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages_per_user), dtype=torch.int32)
    used = 0
    for b, count in enumerate(pages_per_user):
        table[b, :count] = order[used:used + count].to(torch.int32)
        used += count
    k_pages = torch.full((num_pages, page_size, heads, dqk), float("nan"), dtype=dtype)
    v_pages = torch.full((num_pages, page_size, heads, dv), float("nan"), dtype=dtype)
    new_rows, users, positions = [], [], []
    for b, (n, m) in enumerate(zip(seq_lens, q_lens)):
        hist = torch.arange(n - m)
        users.append(torch.full_like(hist, b))
        positions.append(hist)
        new_rows.append(offsets[b] + torch.arange(n - m, n))
    users_t, positions_t = torch.cat(users), torch.cat(positions)
    token = offsets[users_t] + positions_t
    page, slot = table.long()[users_t, positions_t // page_size], positions_t % page_size
    k_pages[page, slot] = k[token]
    v_pages[page, slot] = v[token]
    rows = torch.cat(new_rows)
    q_offsets = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    return dict(q=q, k=k, v=v, offsets=offsets, rows=rows, q_offsets=q_offsets, k_pages=k_pages, v_pages=v_pages,
                table=table, seq_lens=torch.tensor(seq_lens), targets=torch.tensor(targets))


CASES = {
    # name: (new rows per user, tokens per user, targets per user, contextual, window)
    "candidates only": ([5, 3, 1], [40, 21, 9], [5, 3, 1], 0, 0),
    "one token": ([1, 1], [33, 17], [1, 1], 0, 0),
    "new history, no targets": ([7, 1], [50, 12], [0, 0], 0, 0),
    "history and candidates": ([9, 20], [61, 45], [4, 6], 2, 0),
    "contextual and window": ([6, 12, 3], [70, 38, 10], [2, 5, 3], 3, 8),
    "everything new": ([19, 12], [19, 12], [4, 2], 2, 0),
    "a user with nothing new": ([4, 0, 3], [30, 20, 15], [2, 0, 1], 0, 0),
    # More users than a program scans at once when it looks for its user, one with several query blocks.
    "many users": ([1, 2, 0, 3] * 17 + [70], [9, 5, 4, 6] * 17 + [90], [1, 1, 0, 2] * 17 + [10], 0, 0),
}


def _expected(case: dict, contextual: int, window: int, scaling: int, alpha: float) -> torch.Tensor:
    full = hstu_mha_reference(case["q"], case["k"], case["v"], case["offsets"], int(case["seq_lens"].max()), scaling,
                              alpha, True, case["targets"], contextual, window)
    return full[case["rows"]]


def _call(fn, case: dict, contextual: int, window: int, scaling: int, alpha: float, **extra):  # type: ignore[no-untyped-def]
    rows = case["rows"]
    return fn(case["q"][rows], case["k"][rows], case["v"][rows], case["q_offsets"], case["k_pages"], case["v_pages"],
              case["table"], case["seq_lens"], case["targets"], scaling, alpha, contextual, window, **extra)


def _pools(case: dict, layer: int, layers: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's pages as layer ``layer`` of a pool of ``layers``, with one more page (the scratch, last);
    every other entry NaN."""
    def pool(pages: torch.Tensor) -> torch.Tensor:
        out = torch.full((layers, pages.shape[0] + 1, *pages.shape[1:]), float("nan"), dtype=pages.dtype)
        out[layer, :-1] = pages
        return out

    return pool(case["k_pages"]), pool(case["v_pages"])


def _stored(case: dict, k_pool: torch.Tensor, v_pool: torch.Tensor, layer: int, width: int | None = None):  # type: ignore[no-untyped-def]
    """The pools as a store at ``layer`` should leave them: each user's new non-target tokens in their pages
    (those the table has a column for, within ``width`` columns)."""
    want_k, want_v = k_pool.clone(), v_pool.clone()
    page_size = k_pool.shape[2]
    width = case["table"].shape[1] if width is None else width
    q_lens = (case["q_offsets"][1:] - case["q_offsets"][:-1]).tolist()
    for b, (n, m, t) in enumerate(zip(case["seq_lens"].tolist(), q_lens, case["targets"].tolist())):
        for j in range(n - m, n - t):
            if j // page_size < width:
                page, slot, token = int(case["table"][b, j // page_size]), j % page_size, int(case["offsets"][b]) + j
                want_k[layer, page, slot], want_v[layer, page, slot] = case["k"][token], case["v"][token]
    return want_k, want_v


def check_store(fn, name: str, **extra) -> None:  # type: ignore[no-untyped-def]
    """``fn`` (paged_hstu_mha_store's signature) on a case: the attention rows as without the store, and the
    pools as :func:`_stored` says, bit for bit but for the scratch page."""
    q_lens, seq_lens, targets, contextual, window = CASES[name]
    case = _case(q_lens, seq_lens, targets, seed=len(name))
    k_pool, v_pool = _pools(case, layer=1)
    want_k, want_v = _stored(case, k_pool, v_pool, 1)
    rows = case["rows"]
    got = fn(case["q"][rows], case["k"][rows], case["v"][rows], case["q_offsets"], k_pool, v_pool, 1, case["table"],
             case["seq_lens"], case["targets"], 128, 0.25, contextual, window, **extra)
    torch.testing.assert_close(got, _expected(case, contextual, window, 128, 0.25), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_pool[:, :-1], want_k[:, :-1], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_pool[:, :-1], want_v[:, :-1], rtol=0, atol=0, equal_nan=True)


def check_store_past_the_table(fn, **extra) -> None:  # type: ignore[no-untyped-def]
    """New tokens the page table has no column for are not stored (nothing written outside the table)."""
    case = _case([10, 3], [40, 20], [2, 1], seed=3)
    case["table"] = case["table"][:, :2].contiguous()  # 32 tokens a user; user 0's tokens 32..37 have no column
    k_pool, v_pool = _pools(case, layer=0)
    want_k, want_v = _stored(case, k_pool, v_pool, 0, width=2)
    rows = case["rows"]
    fn(case["q"][rows], case["k"][rows], case["v"][rows], case["q_offsets"], k_pool, v_pool, 0, case["table"],
       case["seq_lens"], case["targets"], 128, 0.25, 0, 0, **extra)
    torch.testing.assert_close(k_pool[:, :-1], want_k[:, :-1], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_pool[:, :-1], want_v[:, :-1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_store_writes_the_new_non_target_rows(name: str) -> None:
    check_store(paged_hstu_mha_store_reference, name)


def test_reference_store_skips_tokens_past_the_table() -> None:
    check_store_past_the_table(paged_hstu_mha_store_reference)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_equals_full_attention_rows(name: str) -> None:
    q_lens, seq_lens, targets, contextual, window = CASES[name]
    case = _case(q_lens, seq_lens, targets, seed=len(name))
    got = _call(paged_hstu_mha_reference, case, contextual, window, 128, 0.25)
    want = _expected(case, contextual, window, 128, 0.25)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def check_attention_inputs(fn) -> None:  # type: ignore[no-untyped-def]
    """``fn`` (paged_attention_inputs's signature) on counts with every kind of user, bit for bit against the
    reference, which a hand-worked case pins down first."""
    # Users: nothing cached (2 contextual tokens, 3 history, 1 candidate), 40 cached (past the table's 2
    # pages of 16: keys clamped to 32) with 2 new history and 4 candidates, negative counts (all taken as 0),
    # then one whose tokens run past the request's 9 new tokens.
    cached, hist, cand = torch.tensor([0, 40, -5, 3]), torch.tensor([3, 2, -1, 1]), torch.tensor([1, 4, -2, 9])
    table = torch.tensor([[7, -1], [99, 2], [0, 0], [1, 3]], dtype=torch.int32)
    offsets, seq_lens, targets, pages = paged_attention_inputs_reference(cached, hist, cand, table, 2, 9, 16, 8)
    assert offsets.tolist() == [0, 6, 9, 9, 9] and seq_lens.tolist() == [6, 35, 0, 3]
    assert targets.tolist() == [1, 4, 0, 9] and pages.tolist() == [[7, 0], [7, 2], [0, 0], [1, 3]]
    assert pages.dtype == torch.int32 and offsets.dtype == seq_lens.dtype == targets.dtype == torch.int64
    for got, want in zip(fn(cached, hist, cand, table, 2, 9, 16, 8), (offsets, seq_lens, targets, pages)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    gen = torch.Generator().manual_seed(0)
    for users, width, contextual, dtype in [(70, 9, 2, torch.int32), (130, 40, 0, torch.int64), (1, 1, 1, torch.int64),
                                            (0, 3, 0, torch.int64)]:  # fmt: skip
        cached = torch.randint(-3, 200, (users,), generator=gen).to(dtype)
        cached[::3] = 0
        hist, cand = (torch.randint(-2, 9, (users,), generator=gen).to(dtype) for _ in range(2))
        wide = torch.randint(-5, 50, (users, width + 3), generator=gen).to(dtype)  # int64 tables too
        table = wide[:, 1 : width + 1]  # a view: rows 3 entries apart
        for total_new in (0, 7, 10_000):
            args = (cached, hist, cand, table, contextual, total_new, 16, 40)
            for got, want in zip(fn(*args), paged_attention_inputs_reference(*args)):
                assert got.dtype == want.dtype and torch.equal(got, want), (users, width, total_new)


def test_attention_inputs_reference() -> None:
    check_attention_inputs(paged_attention_inputs_reference)


def test_triton_cases_in_the_interpreter() -> None:
    """tests/interpreted_cases.py (the Triton kernel here and the cached ranker on it) in a subprocess
    with TRITON_INTERPRET=1: Triton reads it when a kernel is defined, so it must not leak into, or
    depend on, the modules this process imported before."""
    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interpreted_cases.py"],
                          cwd=repo, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\b114 passed\b", summary) and "skipped" not in summary, summary


def test_split_count_fills_one_wave_and_keeps_slices_long() -> None:
    from hstu_export.ops._triton.paged import query_blocks, split_count

    # Batch 1, 4 heads, 384 new rows in blocks of 64: 24 programs, 11 slices make 264 (two an SM on an H100).
    assert query_blocks(1, 384, 384, 64) == 6
    assert split_count(24, 4352) == 11
    # Query blocks that give every SM at most one program: two slices when each keeps 1024 keys or more (4
    # users of 384 new rows against 3968 cached: 96 programs), one when shorter (2048 candidates at batch 1
    # against 1024 cached keys: 128 programs).
    assert split_count(4 * query_blocks(4, 4 * 384, 384, 64), 4352, 3968) == 2
    assert split_count(4 * query_blocks(1, 2048, 2048, 64), 3072, 1024) == 1
    assert split_count(128, 3072) == 2  # the keys default to the longest sequence
    # Query blocks that fill the SMs (batch 8 here: 192 programs): one slice.
    assert split_count(4 * query_blocks(8, 8 * 384, 384, 64), 4352) == 1
    # Short sequences are never cut below 256 keys a slice.
    assert split_count(1, 300) == 1 and split_count(1, 1024) == 4
    # The first axis is bounded by the rows in all (each user rounded up) and by users x longest.
    assert query_blocks(3, 3 + 2 + 200, 200, 64) == 6  # by the total: (205 + 3 * 63) // 64
    assert query_blocks(3, 3 * 64, 64, 64) == 3  # by users x longest
    assert query_blocks(2, 0, 0, 64) == 1


def test_split_count_is_arithmetic_on_symbolic_sizes() -> None:
    """In an exported program the users and rows are symbolic: the slice count must be an expression of
    them (no guard, which would fix it at the example's value), equal to the plain rule at every size."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from hstu_export.ops._triton.paged import query_blocks, split_count, workspace_numel

    env = ShapeEnv()

    def symbol(name: str, hint: int) -> torch.SymInt:
        return env.create_symintnode(env.create_symbol(hint, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC),
                                     hint=hint)

    users, rows = symbol("users", 3), symbol("rows", 900)
    blocks = query_blocks(users, rows, torch.sym_max(torch.sym_min(rows, 4352), 1), 64)
    slices = split_count(4 * blocks, 4352, 4352 - rows // users)
    work = workspace_numel(slices, rows * 4 * 128)
    assert not env.guards
    seen = set()
    for b, n in [(1, 1), (1, 384), (2, 700), (3, 900), (4, 1536), (1, 2048), (8, 3072), (32, 12288)]:
        at = {users.node.expr: b, rows.node.expr: n}
        want = split_count(4 * query_blocks(b, n, max(min(n, 4352), 1), 64), 4352, 4352 - n // b)
        got = int(slices.node.expr.xreplace(at))
        assert got == want, (b, n)
        seen.add(got)
        # The workspace: every slice's partials when there are several, a single float with one.
        assert int(work.node.expr.xreplace(at)) == (got * n * 512 if got > 1 else 1), (b, n)
    assert len(seen) >= 3  # the count does follow the size


def test_targets_only_launch_sizes_its_slices_by_the_targets(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The last layer's launch (target rows only) keeps the grid of every new row (a user's blocks may store its
    other new rows), but chooses its key slices for the blocks its targets fill: 8 users of 256 targets in
    blocks of 64 with 4 heads are 128 programs, which two slices spread over an H100's 132 SMs two an SM; the
    grid's 192 would have taken one."""
    import hstu_export.ops._triton.paged as paged
    from hstu_export.ops._triton.configs import AttentionConfig

    grids = {}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            grids[self.name] = tuple(int(g) for g in grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(paged, "_paged_attn_fwd", Recorder("attention"))
    monkeypatch.setattr(paged, "_gate_slices", Recorder("gate"))
    monkeypatch.setattr(paged, "attention_config", lambda *args: AttentionConfig(64, 64, 4, 3))
    users, new, targets, h, d, n = 8, 384, 256, 4, 16, 4352
    uvqk = torch.zeros(users * new, 4 * h * d)
    pool = torch.zeros(2, 8, 64, h, d)
    rows = (torch.arange(1, users + 1) * new - targets).unsqueeze(1) + torch.arange(targets)
    call = dict(q_offsets=torch.arange(users + 1) * new, k_pool=pool, v_pool=pool.clone(), layer=1,
                page_table=torch.zeros(users, 69, dtype=torch.int32), seq_lens=torch.full((users,), n),
                num_targets=torch.full((users,), targets), norm_weight=torch.ones(h * d), norm_bias=torch.zeros(h * d),
                eps=1e-6, num_heads=h, attention_dim=d, linear_dim=d, scaling_seqlen=n, alpha=0.1, max_seq_len=n,
                max_query_len=new)
    out = paged.paged_hstu_mha_gated_triton_fwd(uvqk, **call, target_rows=rows.flatten())
    assert out.shape == (users * targets, 3 * h * d)
    assert grids["attention"] == (48, h, 2)  # 2 slices for the targets' 32 x 4 programs
    paged.paged_hstu_mha_gated_triton_fwd(uvqk, **call)
    assert grids["attention"] == (48, h, 1)  # every new row: 192 programs, one slice
