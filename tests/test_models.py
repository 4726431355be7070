"""Model zoo: presets build and run; batches are deterministic and realistic; schema validation."""

from __future__ import annotations

import pytest
import torch

from hstu_export import generate_batch
from hstu_export.errors import ConfigError, RequestError
from hstu_export.models import PRESETS, HSTUConfig, HstuRankingModel, build_preset, preset_config


def test_presets_match_design():
    expected = {"tiny": (32, 2, 16, 2, 64), "tzrec": (512, 4, 128, 3, 4096), "dlrmv3": (512, 4, 128, 5, 4096)}
    for name, (d, h, dqk, layers, max_seq) in expected.items():
        cfg = preset_config(name)
        assert (cfg.embedding_dim, cfg.num_heads, cfg.attention_dim, cfg.num_layers, cfg.max_seq_len) == (
            d,
            h,
            dqk,
            layers,
            max_seq,
        )
        assert cfg.linear_dim == cfg.attention_dim
    with pytest.raises(ConfigError, match="unknown preset"):
        preset_config("huge")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_forward_on_cpu(name):
    model = build_preset(name)
    schema = model.input_schema()
    batch = generate_batch(schema, 2, seed=1, lengths={"uih_lengths": [3, 7], "candidate_lengths": [2, 5]})
    with torch.no_grad():
        out = model(batch)
    assert set(out) == set(model.config.task_names)
    for value in out.values():
        assert value.shape == (7,)
        assert torch.isfinite(value).all()
        assert ((value > 0) & (value < 1)).all()


def test_batch_generator_is_deterministic_and_realistic():
    schema = build_preset("tiny").input_schema()
    a = generate_batch(schema, 64, seed=4)
    b = generate_batch(schema, 64, seed=4)
    c = generate_batch(schema, 64, seed=5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["uih_item_ids"][:10], c["uih_item_ids"][:10])
    lengths = a["uih_lengths"]
    assert lengths.min() >= 1 and lengths.max() <= 46 and lengths.unique().numel() > 10
    assert a["uih_item_ids"].numel() == lengths.sum()
    assert a["candidate_item_ids"].numel() == a["candidate_lengths"].sum()
    offsets = torch.cumsum(lengths, 0) - lengths
    for user in range(64):
        ts = a["uih_timestamps"][offsets[user] : offsets[user] + lengths[user]]
        assert (ts[1:] > ts[:-1]).all(), "timestamps increase within a user"
        assert a["query_time"][user] > ts.max()
    schema.validate(a)


def test_schema_validation_errors():
    schema = build_preset("tiny").input_schema()
    batch = generate_batch(schema, 3, seed=0)
    missing = {k: v for k, v in batch.items() if k != "user_id"}
    with pytest.raises(RequestError, match="missing feature"):
        schema.validate(missing)
    with pytest.raises(RequestError, match="dtype"):
        schema.validate(dict(batch, user_id=batch["user_id"].to(torch.int32)))
    with pytest.raises(RequestError, match="beyond the exported maximum"):
        schema.validate(batch, max_batch_size=2)
    too_long = dict(batch, uih_lengths=batch["uih_lengths"] + 100)
    with pytest.raises(RequestError, match="beyond the exported maximum 46"):
        schema.validate(too_long)
    with pytest.raises(RequestError, match="sums to"):
        schema.validate(dict(batch, uih_item_ids=batch["uih_item_ids"][:-1]))


def test_a_layout_check_leaves_values_to_the_request_they_are_batched_into():
    """``values=False`` (requests about to be concatenated): a value beyond the exported range passes, a
    length beyond it or a layout error does not; the full check still refuses the value."""
    schema = HstuRankingModel(HSTUConfig()).input_schema()
    batch = generate_batch(schema, 2, seed=4)
    beyond = dict(batch, uih_item_ids=batch["uih_item_ids"] + 10**9)
    assert schema.validate(beyond, values=False) == 2
    with pytest.raises(RequestError, match="uih_item_ids.*beyond the exported maximum"):
        schema.validate(beyond)
    too_long = dict(batch, uih_lengths=torch.tensor([10**6, 1]))
    with pytest.raises(RequestError, match="uih_lengths.*beyond the exported maximum"):
        schema.validate(too_long, values=False)
    with pytest.raises(RequestError, match="values but 'uih_lengths' sums to"):
        schema.validate(dict(batch, uih_item_ids=batch["uih_item_ids"][1:]), values=False)


def test_many_requests_are_checked_as_each_alone(monkeypatch):
    """``validate_each`` (a server's batch of requests) answers for each request what ``validate(values=False)``
    answers for it alone, in the same words; requests whose errors cancel out when concatenated (one user's
    items moved to the next request) are refused each; good requests are never validated one by one."""
    schema = build_preset("tiny").input_schema()
    good = [generate_batch(schema, 1 + i % 3, seed=20 + i) for i in range(6)]
    moved = dict(good[1], uih_item_ids=good[1]["uih_item_ids"][1:])  # one item fewer here ...
    extra = dict(good[2], uih_item_ids=torch.cat([good[1]["uih_item_ids"][:1], good[2]["uih_item_ids"]]))  # ... one more
    requests = [
        good[0], moved, extra, good[3],
        dict(good[4], uih_lengths=good[4]["uih_lengths"] + 100),  # a length beyond the range
        dict(good[5], candidate_item_ids=good[5]["candidate_item_ids"] + 10**9),  # a value: left to the call
        {k: v for k, v in good[0].items() if k != "user_id"},
        dict(good[0], user_id=good[0]["user_id"].to(torch.int32)),
        dict(good[0], query_time=good[0]["query_time"][:0]),
        generate_batch(schema, 4, seed=9),  # more users than allowed
        [1, 2],
    ]
    alone = []
    for request in requests:
        try:
            alone.append(schema.validate(request, 3, values=False))
        except RequestError as exc:
            alone.append(str(exc))
    each = schema.validate_each(requests, 3)
    assert [r if isinstance(r, int) else str(r) for r in each] == alone
    assert alone[0] == 1 and alone[3] == 1 and alone[5] == 3
    assert all("values but 'uih_lengths' sums to" in alone[i] for i in (1, 2))
    assert "'uih_lengths' has length" in alone[4] and "beyond the exported maximum" in alone[4]
    assert all(isinstance(r, str) for r in alone[6:])

    calls = []
    monkeypatch.setattr(type(schema), "validate", lambda *a, **k: calls.append(a))
    assert schema.validate_each(good, 3) == [1 + i % 3 for i in range(6)] and not calls


@pytest.mark.parametrize("together", [False, True], ids=["one-by-one", "together"])
def test_schema_reads_every_bound_and_total_the_same_way_at_once(together):
    """Validation reads its numbers one by one on the CPU and in one transfer on a device: both give the
    same numbers (CPU tensors forced through the device path here), whatever the dtypes."""
    from hstu_export.package.schema import _read_all

    bounded = [torch.tensor([5, -3, 9], dtype=torch.int32), torch.tensor([2.5, -0.25], dtype=torch.float16),
               torch.tensor([True, False]), torch.tensor([2**40, 7], dtype=torch.int64),
               torch.tensor([0.5], dtype=torch.bfloat16),
               # longer than what is read as a list: a tensor reduction
               torch.arange(-100, 4000, dtype=torch.int32).flip(0), torch.linspace(-2.0, 3.0, 500, dtype=torch.float16)]
    lengths = [torch.tensor([3, 4]), torch.tensor([0, 0, 9], dtype=torch.int32)]
    extremes, totals = _read_all(bounded, lengths, together=together)
    assert extremes == [(-3, 9), (-0.25, 2.5), (0, 1), (7, 2**40), (0.5, 0.5), (-100, 3999), (-2.0, 3.0)]
    assert [type(x) for pair in extremes for x in pair] == [int, int, float, float, int, int, int, int, float, float,
                                                           int, int, float, float]
    assert totals == [7, 9]
    schema = build_preset("tiny").input_schema()
    batch = generate_batch(schema, 3, seed=0)
    bad = dict(batch, uih_item_ids=batch["uih_item_ids"].clone())
    bad["uih_item_ids"][1] = -4
    with pytest.raises(RequestError, match="feature 'uih_item_ids' has value -4 below the minimum 0"):
        schema.validate(bad)


def test_config_round_trip_and_validation():
    cfg = preset_config("tzrec")
    assert HSTUConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown keys"):
        HSTUConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(ConfigError, match="num_heads"):
        HSTUConfig(num_heads=0)


def test_user_output_independent_of_batch():
    """A user's scores do not depend on who else is in the batch (explicit scaling_seqlen)."""
    model = HstuRankingModel(HSTUConfig()).eval()
    schema = model.input_schema()
    big = generate_batch(schema, 5, seed=2)
    single = {k: v for k, v in generate_batch(schema, 1, seed=2).items()}
    # Rebuild user 0 of `big` alone.
    h, c = int(big["uih_lengths"][0]), int(big["candidate_lengths"][0])
    for k in ("uih_item_ids", "uih_action_ids", "uih_timestamps"):
        single[k] = big[k][:h]
    single["candidate_item_ids"] = big["candidate_item_ids"][:c]
    for k in ("uih_lengths", "candidate_lengths", "query_time", "user_id", "user_age"):
        single[k] = big[k][:1]
    with torch.no_grad():
        full, alone = model(big), model(single)
    for task in full:
        torch.testing.assert_close(full[task][:c], alone[task], rtol=1e-5, atol=1e-6)
