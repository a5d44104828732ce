"""The tree merge: its fixed order, each process's own shards first (on one device), then log2 rounds
(the splits of processes are in test_reproducible: 2x1, 2x4, 4x2 bitwise against 1x8)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan import admission, merging
from sharded_scan.combiners.sketches.quantiles_exact import RefinePass
from sharded_scan.merging import receives, tree_fold, tree_strides
from sharded_scan.program import program_for_spec
from sharded_scan.sharding import to_host


def device_of(state):
    return next(iter(jax.tree.leaves(state)[0].devices()))


def pair(a, b):
    return (a, b)


def levels_reference(items):
    """Neighbours paired level by level, an odd one out carried up (the tree as first written)."""
    while len(items) > 1:
        paired = [pair(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
        items = paired + ([items[-1]] if len(items) % 2 else [])
    return items[0]


def test_tree_fold_is_the_fixed_balanced_tree_taking_items_lazily():
    for n in range(1, 70):
        taken = []
        items = (taken.append(i) or i for i in range(n))
        assert tree_fold(pair, items) == levels_reference(list(range(n)))
        assert taken == list(range(n))


@pytest.mark.parametrize("per_member", [1, 2, 4, 8])
def test_members_folding_their_own_shards_first_then_pairing_up_give_the_same_tree(per_member):
    for members in range(1, 21):
        states = [tree_fold(pair, range(m * per_member, (m + 1) * per_member)) for m in range(members)]
        for stride in tree_strides(members):
            receiving = [bool(receives(stride, members)(m)) for m in range(members)]
            states = [pair(s, states[m + stride]) if receiving[m] else s for m, s in enumerate(states)]
        assert states[0] == levels_reference(list(range(members * per_member))), members


class Ends(NamedTuple):
    first: jax.Array
    last: jax.Array
    seen: jax.Array


class FirstAndLast(ss.Combiner):
    """The first and last row: a merge that is not commutative (the left state must come first)."""

    def init(self, spec):
        return Ends(jnp.zeros(spec.shape, spec.dtype), jnp.zeros(spec.shape, spec.dtype), jnp.zeros((), bool))

    def add(self, acc, batch, mask):
        idx = jnp.arange(mask.shape[0])
        first = batch[jnp.argmin(jnp.where(mask, idx, mask.shape[0]))]
        last = batch[jnp.argmax(jnp.where(mask, idx, -1))]
        return self.merge(acc, Ends(first, last, jnp.any(mask)))

    def merge(self, a, b):
        return Ends(jnp.where(a.seen, a.first, b.first), jnp.where(b.seen, b.last, a.last), a.seen | b.seen)

    def finalize(self, acc):
        return np.stack([acc.first, acc.last])


@pytest.mark.parametrize("mesh, shards, route", [
    ("data:3", None, "process_tree"),
    ("data:8", 24, "process_tree"),  # one process folds its 24 shards (3 a device) in the tree
])
def test_a_merge_that_is_not_commutative_keeps_the_rows_in_order(mesh, shards, route):
    x = np.arange(301 * 2, dtype=np.float32).reshape(301, 2)
    options = ss.RunOptions(mesh=mesh, logical_shards=shards, microbatch=16, steps_per_call=8)
    prog = program_for_spec(FirstAndLast(), jax.ShapeDtypeStruct((2,), np.float32), 301, options)
    assert prog.merge_route == route and prog.layout.num_steps() == 1  # one step: shard i holds the i-th block of rows
    np.testing.assert_array_equal(ss.run(FirstAndLast(), x, options), x[[0, -1]])
    # The process tree holds tree_fold's stack (log2 of the process's shards), one taken in and a
    # partner's on its first device, not every shard's state
    state = sum(int(np.prod(s.shape[1:])) * s.dtype.itemsize for s in jax.tree.leaves(prog.like))
    shards = prog.layout.num_shards
    assert admission.memory_estimate(prog, temporaries=False)["merge"] <= state * (shards.bit_length() + 2)


def test_a_process_folds_its_shards_on_its_first_device_by_one_compiled_merge(monkeypatch):
    # A jitted merge compiles again for every device it runs on (seconds each for LinearRegression):
    # every pairwise merge of the process runs on one device, its states brought there one at a time.
    calls = []
    real = merging.compile_pair_merge

    def recording(*args):
        merge = real(*args)
        return lambda a, b, operands: calls.append((device_of(a), device_of(b))) or merge(a, b, operands)

    monkeypatch.setattr(merging, "compile_pair_merge", recording)
    x = np.arange(301 * 2, dtype=np.float32).reshape(301, 2)
    options = ss.RunOptions(mesh="data:8", logical_shards=32, microbatch=16, steps_per_call=8)
    np.testing.assert_array_equal(ss.run(FirstAndLast(), x, options), x[[0, -1]])
    assert calls == [(jax.devices()[0], jax.devices()[0])] * 31


def test_a_logical_shards_sum_merges_by_the_device_tree_and_never_gathers():
    x = np.arange(301 * 2, dtype=np.float32).reshape(301, 2) % 7  # sums exact in float32
    options = ss.RunOptions(mesh="data:3", logical_shards=6, microbatch=16, steps_per_call=2)
    prog = program_for_spec(ss.Sum(), jax.ShapeDtypeStruct((2,), np.float32), 301, options)
    assert prog.merge_route == "device_tree" and tree_strides(3) == [1, 2]
    merge = prog.lower_merge().compile().as_text()  # rounds: device 2 left out, then device 0 receiving it
    assert "collective-permute" in merge and "all-gather" not in merge
    np.testing.assert_array_equal(ss.run(ss.Sum(), x, options).sum, x.sum(0))


def random_partials(prog, rng):
    """Partials of ``prog`` as a run could leave them: every integer leaf random (a Wide's limbs
    normalised: the collective's sums carry), but a DistinctCount's unused keys and counts (the identity's)."""
    def leaf(x, s):
        if x.dtype == np.uint8 or isinstance(prog.combiner, RefinePass):
            x = rng.integers(0, min(np.iinfo(x.dtype).max, 1 << 16), x.shape).astype(x.dtype)
        return jax.device_put(x, s.sharding)
    return jax.tree.map(leaf, jax.tree.map(np.asarray, prog.init()), prog.like)


@pytest.mark.parametrize("combiner", [
    RefinePass(np.sort(np.random.default_rng(0).integers(0, 2**32, (3, 2, 5)), axis=-1)),
    ss.DistinctCount(precision=6, exact_up_to=0),  # the estimate alone: registers by maximum
    ss.GroupBy(ss.DistinctCount(precision=6, exact_up_to=0), num_keys=3),  # the inner's, key by key
])
def test_an_order_free_merge_is_one_collective_a_leaf_bitwise_the_trees(combiner, monkeypatch):
    # Exact counts (Wide limbs: psum, then normalised), minima, maxima: one all-reduce a leaf, no
    # all-gather (O(state) a device), bitwise the fixed tree's (itself the same on every split:
    # test_reproducible), under logical_shards and over model.
    spec, rng = jax.ShapeDtypeStruct((3,), np.float32), np.random.default_rng(1)
    if isinstance(combiner, ss.GroupBy):
        spec = (jax.ShapeDtypeStruct((), np.int32), spec)
    for mesh, shards in [("data:8", None), ("data:2,model:2", 8)]:
        prog = program_for_spec(combiner, spec, 301, ss.RunOptions(mesh=mesh, logical_shards=shards))
        assert prog.merge_route == "collective"
        text = prog.lower_merge().as_text()
        assert "all_reduce" in text and "all_gather" not in text
        partials = random_partials(prog, rng)
        got = to_host(prog.merge(partials))
        with monkeypatch.context() as patch:
            patch.setattr(type(combiner), "merge_collectives", lambda self: None)  # the tree, as before
            want = to_host(prog.merge(partials))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shards, tree", [(None, True), (8, True), (6, False)])
def test_a_state_split_over_model_merges_by_the_device_tree(shards, tree):
    # Each device merges its own block of its own shards, then log2 rounds of ppermute: no partial
    # gathered over data (O(S) states a device before), the merge traced once a level, not once a
    # shard. Three shards a device are not tree_fold's tree by levels: gathered over data, as before.
    # Results: the split runs of test_wide_model, test_statistics, test_topk... the whole's (bitwise where
    # exact or a sum; co-moments and moments to rounding: DESIGN.md, logical_shards).
    spec = jax.ShapeDtypeStruct((3,), np.float32)
    prog = program_for_spec(ss.DistinctCount(precision=6), spec, 301,
                            ss.RunOptions(mesh="data:2,model:2", logical_shards=shards))
    assert prog.combiner.partition(prog.mesh) is not None
    assert prog.merge_route == ("device_tree" if tree else "gather_fold")
    text = prog.lower_merge().as_text()
    assert ("collective_permute" in text) is tree and ("all_gather" in text) is not tree
