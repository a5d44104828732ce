"""TopK: the most frequent values with counts, against numpy/pandas, on every device count and across resumes."""

from collections import Counter

import jax
import numpy as np
import pandas as pd
import pytest

import sharded_scan as ss
from sharded_scan import program
from sharded_scan.program import program_for_spec
from tests.helpers import assert_usage_error, control_flow
from tests.test_checkpoint import CrashError, crash_at

KW = {"microbatch": 64, "steps_per_call": 2}
SMALL = ss.TopK(k=10, capacity=256)  # far fewer slots than values: evictions happen
# Micro-batches of at least 1024 rows and 2 rows a monitored slot count their values by hashing (keys.first_rows)
# instead of sorting: runs with TopK(capacity=16) and these micro-batches are hashed.
HASHED = {"microbatch": 1024, "steps_per_call": 1}
M32 = 2**32


def zipf(n, universe=5000, seed=0):
    """Zipf(1.1) ranks over ``universe`` values, relabelled at random (int32)."""
    r = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, universe + 1) ** 1.1)
    ranks = np.searchsorted(cdf / cdf[-1], r.random(n))
    return r.permutation(universe).astype(np.int32)[ranks]


def exact_top(column, k):
    """The k most frequent values and their counts, ties broken by the smaller value."""
    values, counts = np.unique(column, return_counts=True)
    order = np.lexsort((values, -counts))[:k]
    return values[order].astype(np.float64), counts[order]


def check_bounds(column, got):
    """Every listed count is within its error of the truth, and nothing left out beats ``bound``."""
    truth = pd.Series(column).value_counts(dropna=False)
    listed = got.counts > 0  # empty slots count 0
    true = truth.reindex(got.values[listed]).to_numpy()
    assert np.all(got.counts[listed] <= true) and np.all(true <= got.counts[listed] + got.errors[listed])
    assert truth.drop(got.values[listed]).max() <= got.bound


# One summary over the whole stream; and summaries merged: four devices of one shard each, the program of
# test_logical_shards_...'s data:4 run (the same step shape: no compile of its own, unlike a data:8 run's).
@pytest.mark.parametrize("mesh, shards", [("data:1", None), ("data:4", 4)])
def test_zipf_top_values_are_exact_in_random_sorted_and_reversed_order_and_counts_within_errors(mesh, shards):
    x = zipf(6000)
    data = np.stack([x, np.sort(x), np.sort(x)[::-1]], 1)
    got = ss.run(SMALL, data, mesh=mesh, logical_shards=shards, **KW)
    assert np.all(got.bound > 0)  # values were dropped: the summary is full
    for j in range(3):
        values, counts = exact_top(data[:, j], 10)
        np.testing.assert_array_equal(got.values[j], values)
        check_bounds(data[:, j], type(got)(*(f[j] for f in got)))
    # In random order the frequent values are monitored from their first row: exact counts, no error.
    np.testing.assert_array_equal(got.counts[0], exact_top(x, 10)[1])
    assert got.certain[0] and np.all(got.errors[0] == 0)


def test_few_values_are_counted_exactly_like_value_counts_with_nan_and_signed_zeros():
    r = np.random.default_rng(1)
    values = np.array([np.nan, -0.0, 0.0, 2.5, -1.0, 7.0], np.float32)
    column = r.choice(values, 2 * 1024 * 2 + 333, p=[0.1, 0.2, 0.2, 0.3, 0.15, 0.05])  # hashed micro-batches
    got = ss.run(ss.TopK(k=8, capacity=16), column, mesh="data:2", **HASHED)  # as on 8, a cheaper compile
    counts = pd.Series(column).value_counts(dropna=False)
    assert got.values.shape == (8,) and got.certain and got.bound == 0
    assert np.isnan(got.values[5:]).all() and (got.counts[5:] == 0).all()  # five distinct values
    for value, count in zip(got.values[:5], got.counts[:5], strict=True):
        assert count == (counts[np.nan] if np.isnan(value) else counts[value])


# nan_policy="omit" (pandas' value_counts(): NaN dropped, and an inf here) folds each column's summary with a mask per
# column. Main ran EachColumn(TopK): one-column states under jax.vmap, whose lax.conds became selects, so the hash and
# its sort fallback both ran every micro-batch (3.0-3.7x propagate's CPU, bench/README.md).
def test_omit_skips_each_value_where_it_stands_like_value_counts_with_the_control_flow_of_propagate():
    from sharded_scan.combiners.wrappers.policies import apply_policies

    f = jax.ShapeDtypeStruct
    for combiner, spec in ((ss.TopK(k=8, capacity=16), f((3,), np.float64)),
                           (ss.Weighted(ss.TopK(k=8, capacity=16)), (f((), np.float64), f((3,), np.float64)))):
        batch = jax.tree.map(lambda s: f((1024, *s.shape), s.dtype), spec)  # hashed (traced only)
        flows = [control_flow(jax.make_jaxpr(c.add)(jax.eval_shape(c.init, spec), batch, f((1024,), bool)).jaxpr)
                 for c in (apply_policies(combiner, nan_policy=p) for p in ("propagate", "omit"))]
        assert flows[1] == flows[0], (combiner, flows)  # the sort only in the fallback's branch
    # NaN and +-inf spread differently per column (+-0 one value); micro-batches where column 1 holds none; a column
    # of NaN and inf alone. Hashed micro-batches on 2 devices: each folds, then the summaries merge.
    r = np.random.default_rng(1)
    n = 2 * 1024 * 2 + 333
    values = np.array([np.nan, -0.0, 0.0, 2.5, -1.0, 7.0, np.inf, -np.inf])
    x = np.stack([r.choice(values, n, p=[0.1, 0.2, 0.2, 0.25, 0.15, 0.05, 0.03, 0.02]),
                  r.integers(-6, 6, n) * 0.5, np.where(r.random(n) < 0.5, np.nan, np.inf)], 1)
    x[r.random(n) < 0.2, 1] = np.inf
    x[1024:3072, 1] = np.nan
    got = ss.run(ss.TopK(k=8, capacity=16), x, mesh="data:2", nan_policy="omit", **HASHED)
    assert got.values.shape == (3, 8) and got.values.dtype == np.float64 and got.counts.dtype == np.int64
    assert got.certain.all() and (got.errors == 0).all()  # at most 16 values a column: all monitored, exact
    for j in range(3):
        truth = pd.Series(np.where(np.isfinite(x[:, j]), x[:, j], np.nan)).value_counts(dropna=True)
        order = np.lexsort((truth.index.to_numpy(), -truth.to_numpy()))  # ties: the smaller value first
        m = min(len(order), 8)
        np.testing.assert_array_equal(got.values[j, :m], truth.index.to_numpy()[order[:m]])
        np.testing.assert_array_equal(got.counts[j, :m], truth.to_numpy()[order[:m]])
        assert np.isnan(got.values[j, m:]).all() and (got.counts[j, m:] == 0).all()
        assert got.bound[j] == (truth.to_numpy()[order[8]] if len(order) > 8 else 0)  # the 9th value's count


def test_logical_shards_give_bitwise_the_same_result_on_1_2_4_devices_and_split_over_model_and_resume_across(tmp_path):
    x = np.stack([zipf(3001, seed=2), zipf(3001, seed=3), zipf(3001, seed=4)], 1)
    # 4 shards: 4, 2 and 1 a device, as with 8 (tested for every device count in test_engine), but
    # each program merges 4 summaries, not 8: their compile is about half. On data:4,model:2 each
    # device counts 2 of the 3 columns (one padded) and merges its own: bitwise data:4's (data:8's).
    meshes = ("data:1", "data:2", "data:4", "data:4,model:2")
    runs = [ss.run(SMALL, x, mesh=mesh, logical_shards=4, **KW) for mesh in meshes]
    for got in runs[1:]:
        for a, b in zip(got, runs[0], strict=True):
            np.testing.assert_array_equal(a, b)
    # The split summaries' checkpoint resumes on a mesh without model (test_wide_model converts both ways).
    # 12 steps of 256 rows: a save every 4 (each save a few hundredths of a second of CPU), killed after the first
    options = ss.CheckpointOptions(str(tmp_path), every_steps=4)
    with pytest.raises(CrashError):
        ss.run(SMALL, x, mesh="data:4,model:2", logical_shards=4, checkpoint=options, progress=crash_at(5), **KW)
    again, report = ss.run_with_report(SMALL, x, mesh="data:4", logical_shards=4, checkpoint=options, **KW)
    assert report.resumed_from_step == 4
    for a, b in zip(again, runs[0], strict=True):
        np.testing.assert_array_equal(a, b)
    for j in range(3):
        check_bounds(x[:, j], type(again)(*(f[j] for f in again)))
        exact = again.errors[j] == 0  # counted from their first row: the exact counts
        assert exact[:3].all()
        truth = Counter(x[:, j].tolist())
        np.testing.assert_array_equal(again.counts[j][exact], [truth[v] for v in again.values[j][exact]])


def test_the_summary_keeps_lax_top_k_s_choice_found_by_its_guesses_or_bit_by_bit():
    """``topk._select`` chooses what ``lax.top_k`` would (ties: the lower index) on each of its paths: a
    guessed threshold (a full summary's steady state: many ties at ``1 + D``, or ``2 + D``), all valid
    entries fitting, and the bit-by-bit search where the guesses miss (distinct float scores)."""
    import jax
    import jax.numpy as jnp

    from sharded_scan.combiners.sketches.topk import _select

    r, c, n = np.random.default_rng(5), 64, 320
    second = r.choice([5.0, 6.0, 8.0], (3, n), p=[0.6, 0.35, 0.05])  # the new part's next score: 6
    second[:, :c] = np.where(np.arange(c) < 30, 7.0, 4.0)
    cases = [np.where(r.random((3, n)) < 0.9, 9.0, 10.0 + r.integers(0, 3, (3, n))), second,  # the guesses
             r.standard_normal((3, n)) * 1e3, r.integers(0, 4, (3, n)) * 1.0]  # bit by bit; all fit
    select = jax.jit(lambda s, v: _select(s, v, c))
    for score, share in zip(cases, (1.0, 1.0, 0.9, 0.15), strict=True):
        score, valid = jnp.asarray(score, jnp.float32), jnp.asarray(r.random((3, n)) < share)
        index, kept, chosen = select(score, valid)
        _, best = jax.lax.top_k(jnp.where(valid, score, -jnp.inf), c)
        want = np.zeros((3, n), bool)
        np.put_along_axis(want, np.asarray(best), True, axis=1)
        want &= np.asarray(valid)
        np.testing.assert_array_equal(chosen, want)
        for j in range(3):
            slots = np.flatnonzero(want[j])
            assert np.asarray(kept[j]).sum() == len(slots) and np.asarray(kept[j])[: len(slots)].all()
            np.testing.assert_array_equal(np.asarray(index[j])[: len(slots)], slots)  # in index order


def test_strings_are_counted_by_their_hash_ids():
    counts = {"the": 120, "of": 80, "and": 40, "sharded": 20, "scan": 10, "rare": 1}
    words = np.random.default_rng(0).permutation([w for w, c in counts.items() for _ in range(c)])
    ids = ss.hash_strings(words)
    assert ids.dtype == np.int64 and np.array_equal(ss.hash_strings([words[0]]), ids[:1])  # stable
    got = ss.run(ss.TopK(k=3, capacity=16), ids, mesh="data:2", **KW)  # slots for every word, as the default's 4096
    names = dict(zip(ids.tolist(), words.tolist(), strict=True))
    assert [names[int(v)] for v in got.values] == ["the", "of", "and"]
    np.testing.assert_array_equal(got.counts, [120, 80, 40])


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: ss.TopK(k=0), ["k", "positive"]),
        (lambda: ss.TopK(k=2.5), ["k"]),
        (lambda: ss.TopK(k=100, capacity=10), ["capacity", "at least k"]),
        (lambda: ss.run(ss.TopK(), np.array([["a"]] * 4)), ["numeric"]),
        (lambda: ss.run(ss.TopK(), np.zeros((4, 2, 2), np.float32)), ["(d,)"]),
    ],
)
def test_bad_arguments_are_one_clear_line(make, words):
    assert_usage_error(make, words)




def colliding_keys(count, bits, seed=0, wide=False):
    """``count`` distinct keys that round 0 of ``keys.round_hash`` sends to one slot of a ``2^bits`` table:
    the 32-bit mixer (lowbias32) run backwards from outputs sharing their top ``bits``; 64-bit keys: keys
    sharing their fold of the high half onto the low one too (``v`` and ``v ^ m * (2^32 + 1)``)."""
    r = np.random.default_rng(seed)
    mixed = (r.choice(1 << (32 - bits), count, replace=False).astype(np.uint64) | (5 << (32 - bits))) % M32
    inv1, inv2 = pow(0x7FEB352D, -1, M32), pow(0x846CA68B, -1, M32)

    def unshift(x, s):  # the inverse of x ^= x >> s
        y = x
        for _ in range(32 // s + 1):
            y = x ^ (y >> s)
        return y

    x = [int(v) for v in mixed]
    x = [unshift(v, 16) for v in x]
    x = [unshift(v * inv2 % M32, 15) for v in x]
    x = [unshift(v * inv1 % M32, 16) for v in x]
    keys = np.array([v ^ 0x9E3779B9 for v in x], np.uint64)  # round 0's seed: GOLDEN * 1
    return keys if not wide else keys * np.uint64(M32 + 1)  # 64 bits: high half = low half, their fold 0


def test_select_packs_both_ranks_into_one_running_sum_up_to_its_bound_and_not_past_it():
    """``_select`` ranks the entries above the threshold in the low 15 bits of one running sum and the ties above
    them while a row holds fewer than 2^15 entries: at 2^15 - 1 entries the most above (every valid one fitting in
    ``capacity = n - 1``: 0x7FFE) and the most ties (all but one entry, 0x7FFE << 15) stay in their bits; at 2^15 + 1
    (0x8000 above: past 15 bits) it takes two sums. Each row chooses lax.top_k's entries, in index order."""
    import jax
    import jax.numpy as jnp

    from sharded_scan.combiners.sketches.topk import _select

    r = np.random.default_rng(11)
    for n in (2**15 - 1, 2**15 + 1):
        c = n - 1
        score = np.stack([np.where(np.arange(n) == n - 1, 9.0, 5.0), np.ones(n), r.permutation(n) * 1.0])
        valid = np.ones((3, n), bool)
        valid[1, 7] = False  # n - 1 valid entries: all fit, all above the threshold 0
        index, kept, chosen = jax.jit(lambda s, v, c=c: _select(s, v, c))(jnp.asarray(score, jnp.float32), valid)
        _, best = jax.lax.top_k(jnp.where(valid, jnp.asarray(score, jnp.float32), -jnp.inf), c)
        want = np.zeros((3, n), bool)
        np.put_along_axis(want, np.asarray(best), True, axis=1)
        want &= valid
        np.testing.assert_array_equal(chosen, want)
        for j in range(3):
            slots = np.flatnonzero(want[j])
            assert len(slots) == c and np.asarray(kept[j]).all()
            np.testing.assert_array_equal(np.asarray(index[j]), slots)


def test_keep_with_new_keeps_what_keep_largest_keeps_with_the_same_counts_and_bound():
    """``topk.keep_with_new`` (the micro-batch's candidates as int32 runs, their slack the bound) keeps
    ``keep_largest``'s entries, exact counts, slacks and new bound: counts past 2^16 and 2^32 (carried limbs),
    ties at the bound's ``1 + D``, dropped entries on either side deciding the bound, a column that fits."""
    import jax
    import jax.numpy as jnp

    from sharded_scan.combiners import wide
    from sharded_scan.combiners.sketches.topk import LIMBS, keep_largest, keep_with_new

    r, c, m = np.random.default_rng(7), 64, 256
    bound = np.array([70_000, 3, 2**33 + 5])  # D: over a limb, small, over 32 bits
    count = r.choice([0, 1, 2, 65_535, 2**40], (3, c)) + r.integers(0, 3, (3, c))
    slack = r.choice([0, 4, 2**20], (3, c))
    runs = r.choice([1, 1, 1, 2, 3, 70_000], (3, m)).astype(np.int32)
    valid = r.random((3, c + m)) < np.array([[0.95], [0.9], [0.2]])  # the last column: every valid one fits
    keys = (r.permutation(3 * (c + m)).reshape(3, c + m) * 7919 + 11).astype(np.uint32)  # distinct

    def of(x):
        return wide.add(wide.of_int32(np.asarray(x) & 0xFFFF, LIMBS),
                        wide.Wide(jnp.asarray(np.stack([np.zeros_like(x), (x >> 16) & 0xFFFF, x >> 32], -1),
                                              jnp.int32)))

    d = of(bound)
    ours = jax.jit(lambda k, n, s, u, v, b: keep_with_new(k, n, s, u, v, b, c))(keys, of(count), of(slack), runs,
                                                                                valid, d)
    everything = (wide.Wide(jnp.concatenate([of(count).limbs, wide.of_int32(runs, LIMBS).limbs], 1)),
                  wide.Wide(jnp.concatenate([of(slack).limbs, jnp.broadcast_to(d.limbs[:, None], (3, m, LIMBS))], 1)))
    theirs = jax.jit(lambda k, n, s, v, b: keep_largest(k, n, s, v, b, c))(keys, *everything, valid, d)
    np.testing.assert_array_equal(ours[3], theirs[3])
    np.testing.assert_array_equal(ours[4].limbs, theirs[4].limbs)
    assert wide.to_int(ours[4]).tolist() != bound.tolist()  # something was dropped above D
    for j in range(3):  # the same entries (keep_largest's are in score order, ours in index order)
        mine, want = np.argsort(np.asarray(ours[0][j])), np.argsort(np.asarray(theirs[0][j]))
        np.testing.assert_array_equal(np.asarray(ours[0][j])[mine], np.asarray(theirs[0][j])[want])
        for got, ref in ((ours[1], theirs[1]), (ours[2], theirs[2])):
            np.testing.assert_array_equal(np.asarray(got.limbs[j])[mine], np.asarray(ref.limbs[j])[want])


def test_hashing_finds_each_rows_first_row_under_colliding_keys_and_says_when_it_gives_up():
    import jax
    import jax.numpy as jnp

    from sharded_scan.combiners.sketches.keys import first_rows, round_hash

    n, bits = 600, 12  # first_rows' table for 600 rows: 2^12 slots
    r = np.random.default_rng(3)
    bad = colliding_keys(40, bits)
    slots = round_hash(jnp.asarray(bad.astype(np.uint32)), jnp.int32(0), bits)
    assert len(np.unique(np.asarray(slots))) == 1  # the construction: every key in one slot in round 0
    keys = np.stack([r.choice(bad, n), r.integers(0, 2**32, n, dtype=np.uint64) % 7,
                     r.integers(0, 2**32, n, dtype=np.uint64)]).astype(np.uint32)
    valid = r.random((3, n)) < 0.9

    def want(k, v):
        out = np.full(k.shape, -1)
        for j in range(k.shape[0]):
            seen = {}
            for i in np.flatnonzero(v[j]):
                out[j, i] = seen.setdefault(int(k[j, i]), i)
        return out

    found = jax.jit(first_rows, static_argnums=2)
    rep, done = found(jnp.asarray(keys), jnp.asarray(valid), None)
    assert bool(done)
    np.testing.assert_array_equal(rep, want(keys, valid))
    rep, done = found(jnp.asarray(keys), jnp.asarray(valid), 1)  # one round: the colliding keys left over
    first = keys[0][valid[0]][0]  # round 0 resolves only the key of the slot's lowest row
    assert not bool(done)
    np.testing.assert_array_equal(np.asarray(rep)[0] >= 0, valid[0] & (keys[0] == first))
    with jax.enable_x64(True):  # 64-bit keys whose 32-bit folds are all one, and the extremes
        wide = np.concatenate([colliding_keys(30, bits, wide=True), np.array([0, 2**63, 2**64 - 1], np.uint64)])
        keys = r.choice(wide, (2, n))
        valid = np.ones((2, n), bool)
        rep, done = found(jnp.asarray(keys), jnp.asarray(valid), None)
        assert bool(done)
        np.testing.assert_array_equal(rep, want(keys, valid))


def test_running_sum_and_max_equal_cumsum_and_cummax_on_random_and_edge_int32_rows():
    """keys.running_sum / running_max / running_min (TopK's ranks and run ends, DistinctCount's exact slots,
    fold_groups' run starts) give ``jnp.cumsum`` / ``lax.cummax`` / ``lax.cummin`` (reversed) bit for bit:
    all-False, all-True, random 0/1 and full-range int32 rows (wrapping sums), and one element."""
    import jax
    import jax.numpy as jnp

    from sharded_scan.combiners.sketches.keys import running_max, running_min, running_sum

    r = np.random.default_rng(5)
    info = np.iinfo(np.int32)
    for n in (1, 37):
        x = np.stack([np.zeros(n), np.ones(n), r.random(n) < 0.3,
                      r.choice([info.min, info.max, -1, 0, 1, *r.integers(info.min, info.max, 4)], n)]).astype(np.int32)
        got = jax.jit(lambda x: (running_sum(x), running_max(x, axis=1), running_max(x[3]),
                                 running_min(x, axis=1, reverse=True)))(jnp.asarray(x))
        want = (jnp.cumsum(x, axis=1), jax.lax.cummax(jnp.asarray(x), axis=1), jax.lax.cummax(jnp.asarray(x[3])),
                jax.lax.cummin(jnp.asarray(x), axis=1, reverse=True))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype == jnp.int32
            np.testing.assert_array_equal(g, w)


def hashed_columns(n, seed=0):
    """int64 rows ``(n, 3)``: Zipf over values whose 32-bit folds and round-0 slots are all one, with the
    int64 extremes; five values (the extremes among them), counted exactly; values mostly seen once."""
    r = np.random.default_rng(seed)
    info = np.iinfo(np.int64)
    table = np.concatenate([[info.min, info.max, -1, 0], colliding_keys(60, 13, wide=True).view(np.int64)])
    few = np.array([info.min, info.max, -1, 0, 2**40])
    return np.stack([table[zipf(n, universe=len(table), seed=seed) % len(table)], r.choice(few, n),
                     r.integers(-(2**62), 2**62, n)], 1)


def test_hashed_micro_batches_count_like_value_counts_with_colliding_extreme_and_string_values():
    # Eight devices: each folds two or three hashed micro-batches (the last step's part padding, some all padding), as
    # one device alone folds them, then the summaries merge; the program test_hashed_top_k_resumes_... runs again.
    n = 8 * 1024 * 2 + 333
    x = hashed_columns(n)
    got = ss.run(ss.TopK(k=3, capacity=16), x, mesh="data:8", **HASHED)
    assert got.values.dtype == np.int64 and got.bound[2] > 0  # the third column overflows the summary
    for j in range(3):
        check_bounds(x[:, j], type(got)(*(f[j] for f in got)))
    values, counts = np.unique(x[:, 0], return_counts=True)
    np.testing.assert_array_equal(got.values[0][:2], values[np.lexsort((values, -counts))[:2]])
    truth = pd.Series(x[:, 1]).value_counts()
    assert got.certain[1] and np.all(got.errors[1] == 0)
    np.testing.assert_array_equal(got.counts[1], truth.reindex(got.values[1]).to_numpy())
    n, mesh = 2 * 1024 * 2 + 333, "data:2"  # strings (int64 ids): on 2 devices, a cheaper compile than 8
    words = np.random.default_rng(2).choice(np.array(["a", "a\x00", "é\x00\x00", "\U0001f600", "\x00", ""],
                                                     dtype=object), n)
    top = ss.run(ss.TopK(k=6, capacity=16), pd.DataFrame({"w": words}), mesh=mesh, **HASHED)
    counts = pd.Series(words).value_counts()
    assert top.certain[0] and top.values[0].tolist() == sorted(
        counts.index, key=lambda s: (-counts[s], int(ss.hash_strings([s])[0])))
    np.testing.assert_array_equal(top.counts[0], counts[top.values[0]].to_numpy())


def test_hashed_top_k_resumes_bitwise_and_falls_back_to_the_sort_when_hashing_gives_up(tmp_path, monkeypatch):
    from sharded_scan.combiners.sketches import keys

    x = hashed_columns(8 * 1024 * 3, seed=4)
    combiner, run = ss.TopK(k=3, capacity=16), dict(mesh="data:8", **HASHED)
    whole = ss.run(combiner, x, **run)
    options = ss.CheckpointOptions(str(tmp_path), every_steps=1)
    with pytest.raises(CrashError):
        ss.run(combiner, x, checkpoint=options, progress=crash_at(2), **run)
    again = ss.run(combiner, x, checkpoint=options, **run)
    for a, b in zip(again, whole, strict=True):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setattr(keys, "HASH_ROUNDS", 1)  # the colliding keys stay unresolved: the sort counts them
    sorted_ = ss.run(ss.TopK(k=2, capacity=16), x, **run)  # another k: a program traced afresh, not the memoized
    for j in range(3):
        check_bounds(x[:, j], type(sorted_)(*(f[j] for f in sorted_)))
    for got in (sorted_, whole):
        np.testing.assert_array_equal(got.counts[1], pd.Series(x[:, 1]).value_counts().reindex(
            got.values[1]).to_numpy())


def default_microbatch(combiner, spec, num_rows, **options):
    """The micro-batch the job's programs run (its layout's), with no data made and nothing traced (the memory
    check, which traces a step, 0.5 CPU-s a job, is left out by the test)."""
    return program_for_spec(combiner, spec, num_rows, ss.RunOptions(**options)).layout.microbatch


# A job's default micro-batch holds 16 values a monitored slot (topk.MICROBATCH_PER_SLOT), shared by its columns:
# one column of the default 4096 slots, 65536 rows, where the 4 MiB default gave 16384 (1.2x slower,
# bench/README.md); 8 columns keep 16384 (a larger hash table left the caches: 1.7x slower at 65536).
def test_the_default_micro_batch_holds_16_values_a_slot_and_the_top_values_match_value_counts_on_1_and_8_devices(
        monkeypatch):
    monkeypatch.setattr(program, "check_fits", lambda job: None)
    one, eight = jax.ShapeDtypeStruct((), np.int64), jax.ShapeDtypeStruct((8,), np.float64)
    keyed = (jax.ShapeDtypeStruct((), np.int32), one)
    assert default_microbatch(ss.TopK(), one, 4_000_000) == 65536
    assert default_microbatch(ss.TopK(capacity=16384), one, 4_000_000) == 262144  # hashed, not sorted
    assert default_microbatch(ss.GroupBy(ss.TopK(), num_keys=4), keyed, 4_000_000) == 32768  # 2 values a row
    assert default_microbatch(ss.TopK(), eight, 1_000_000) == 16384  # the 4 MiB default: unchanged
    assert default_microbatch(ss.TopK(capacity=256), one, 4_000_000) == 16384
    assert default_microbatch(ss.TopK(), eight.update(shape=()), 4_000_000, nan_policy="omit") == 65536  # as above
    # A small job folds one micro-batch a shard, as before; logical_shards' and an asked micro-batch are kept.
    assert default_microbatch(ss.TopK(), one, 100_000, mesh="data:1") == 114_688
    assert default_microbatch(ss.TopK(), one, 4_000_000, logical_shards=8, mesh="data:8") == 256
    assert default_microbatch(ss.TopK(), one, 4_000_000, microbatch=1024) == 1024
    # More values than codegen.SMALL_JOB_VALUES, of no multiple of the micro-batch: the last one is partly masked.
    x = zipf(2_100_003, seed=5)
    want = pd.Series(x).value_counts().head(10)
    monkeypatch.undo()
    for mesh in ("data:1", "data:8"):
        got = ss.run(ss.TopK(k=10), x, mesh=mesh)
        assert got.certain and np.all(got.errors == 0)
        np.testing.assert_array_equal(got.values, want.index.to_numpy())
        np.testing.assert_array_equal(got.counts, want.to_numpy())


def test_a_micro_batch_too_wide_for_the_int32_hash_table_is_counted_by_the_sort():
    # keys.first_rows lays the columns' tables (4n slots each) side by side in one table indexed by int32: 512
    # columns of 2^20 rows (a micro-batch a user may set on a large accelerator) would need 2^31 slots. Main raised
    # OverflowError while tracing (a traceback, where the 2-D table before it ran); the sort counts them instead.
    import jax
    import jax.numpy as jnp

    from sharded_scan.combiners.sketches import keys

    combiner, mb = ss.TopK(k=2, capacity=16), 2**20 - 16
    for d in (511, 512):  # traced only: nothing of this size is allocated
        spec = jax.ShapeDtypeStruct((d,), jnp.float32)
        acc = jax.eval_shape(lambda spec=spec: combiner.init(spec))
        out = jax.eval_shape(combiner.add, acc, jax.ShapeDtypeStruct((mb, d), jnp.float32),
                             jax.ShapeDtypeStruct((mb,), bool))
        assert out.keys.shape == (d, 16)
    assert keys.hash_fits(511, mb + 16) and not keys.hash_fits(512, mb + 16)  # 511 columns still hash


def test_a_tpu_counts_each_micro_batch_by_its_sort_which_folds_the_hash_s_summary():
    # XLA:TPU's scatters and gathers are slower than its sort (a hashed micro-batch took 1.2-2.5x the sort's time on
    # a TPU v5e): lowered for a TPU (no TPU needed to lower), the add keeps none of the hash's scatters; and the sort
    # folds the summary the hash folds, here over float columns of NaN, +-inf, +-0 and subnormals, padding rows too.
    r = np.random.default_rng(5)
    edges = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38], np.float32)
    x = np.where(r.random((3, 1024, 2)) < 0.1, r.choice(edges, (3, 1024, 2)), zipf(3 * 2048).reshape(3, 1024, 2))
    x = x.astype(np.float32)
    mask = np.arange(1024) < np.array([[1024], [1000], [7]])
    c = ss.TopK(k=5, capacity=16)
    add = jax.jit(c.add)
    acc = c.init(jax.ShapeDtypeStruct((2,), np.float32))
    cpu = add.trace(acc, x[0], mask[0]).lower(lowering_platforms=("cpu",)).as_text().count("stablehlo.scatter")
    tpu = add.trace(acc, x[0], mask[0]).lower(lowering_platforms=("tpu",)).as_text().count("stablehlo.scatter")
    assert tpu < cpu, (tpu, cpu)
    hashed, sorted_ = acc, acc
    for batch, m in zip(x, mask, strict=True):
        hashed = jax.jit(c._add_by_hash)(hashed, batch, m)
        sorted_ = jax.jit(c._add_by_sort)(sorted_, batch, m)
    got, want = c.finalize(sorted_), c.finalize(hashed)
    for field in ("values", "counts", "errors", "bound", "certain"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert np.all(want.counts[:, 0] > 0)
