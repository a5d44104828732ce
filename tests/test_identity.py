"""A job's identity: what names it, what leaves it the same job, and how a difference is worded."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.digest import json_digest
from sharded_scan.identity import files_difference, job_difference, job_digest
from sharded_scan.program import build_program
from sharded_scan.sources import as_source

X = np.ones((300, 3), np.float32)


def fingerprint(combiner, data=X, **options):
    return build_program(combiner, as_source(data), ss.RunOptions(**{"microbatch": 8, **options})).fingerprint


def test_the_mesh_is_not_the_job_but_the_data_and_the_microbatch_are():
    job = fingerprint(ss.Gram(), mesh="data:2")
    assert fingerprint(ss.Gram(), mesh="data:4", steps_per_call=3) == job
    assert job_difference(job, fingerprint(ss.Gram(), mesh="data:4", microbatch=16)) == \
        "microbatch is 8 there but 16 here"
    assert job_difference(job, fingerprint(ss.Gram(), X[:200])) == "data.num_rows is 300 there but 200 here"
    assert job_digest(job) == json_digest(job) != job_digest(fingerprint(ss.Gram(), X[:200]))


def test_edited_user_code_is_worded_as_code_that_changed():
    first = fingerprint(ss.from_fn(lambda c, b: c + b.sum(0), jnp.zeros(3)))
    edited = fingerprint(ss.from_fn(lambda c, b: c + 2 * b.sum(0), jnp.zeros(3)))
    assert job_difference(first, first) is None
    diff = job_difference(first, edited)
    assert diff.startswith("the code of ") and "<lambda>" in diff and "changed since" in diff, diff


def test_files_are_compared_apart_and_only_when_the_checkpoint_names_them():
    saved = {"combiner": {"combiner": "Gram"}, "files": {"/d/x.npy": "8 bytes, modified A"}}
    now = {"combiner": {"combiner": "Gram"}, "files": {"/d/x.npy": "8 bytes, modified B"}, "code": {"f": "1"}}
    assert job_difference(saved, now) is None  # older checkpoints lack "code"; files are not the job
    assert files_difference(saved, now) == "/d/x.npy is '8 bytes, modified A' there but '8 bytes, modified B' here"
    assert files_difference({"combiner": {"combiner": "Gram"}}, now) is None  # an older format: no files saved


@pytest.mark.parametrize("combiner, data", [(ss.Covariance(), X), (ss.Weighted(ss.TopK(k=3)), (X[:, 0], X)),
                                            (ss.DistinctCount(), X)])
def test_a_checkpoint_from_before_the_model_split_names_the_same_job(combiner, data):
    now = fingerprint(combiner, data)
    assert "model_shards" in json.dumps(now)
    before = json.loads(json.dumps(now).replace(', "model_shards": "1"', ""))  # written before the field existed
    assert "model_shards" not in json.dumps(before) and job_difference(before, now) is None
    assert job_difference(before, fingerprint(ss.Gram(), X)) is not None


def test_with_digests_on_both_sides_files_are_compared_by_their_bytes():
    def files(**stamps):
        return {"files": {"/d/x.npy": ", sha256 ".join(stamps.values())}}

    same_bytes = files(stamp="8 bytes, modified A", sha="aa"), files(stamp="8 bytes, modified B", sha="aa")
    assert files_difference(*same_bytes) is None  # a copy that lost its time
    a, b = files(stamp="8 bytes, modified A", sha="aa"), files(stamp="8 bytes, modified A", sha="bb")
    changed = files_difference(a, b)
    assert changed.startswith("/d/x.npy holds other bytes than then") and "modification time are the same" in changed
    assert "modified B" in files_difference(files(stamp="8 bytes, modified A"), files(stamp="8 bytes, modified B",
                                                                                        sha="aa"))
    assert files_difference(files(stamp="8 bytes, modified A"), files(stamp="8 bytes, modified A", sha="aa")) is None
