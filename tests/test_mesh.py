"""make_mesh: spec strings to meshes, and clear errors for specs that do not fit."""

import jax
import pytest

import sharded_scan as ss
from sharded_scan.mesh import parse_mesh_spec


@pytest.mark.parametrize(
    "spec, names, sizes",
    [
        ("data:8", ("data",), (8,)),
        ("data:-1", ("data",), (8,)),
        ("data:4,model:2", ("data", "model"), (4, 2)),
        ("data:-1,model:2", ("data", "model"), (4, 2)),
        ("data:2", ("data",), (2,)),
    ],
)
def test_make_mesh_shapes(spec, names, sizes):
    mesh = ss.make_mesh(spec)
    assert mesh.axis_names == names
    assert tuple(mesh.shape[n] for n in names) == sizes


def test_default_mesh_uses_every_device():
    mesh = ss.make_mesh()
    assert mesh.shape["data"] == jax.device_count() == 8


@pytest.mark.parametrize(
    "spec, words",
    [
        ("data:16", ["16", "8"]),
        ("data:4,model:4", ["16", "8"]),
        ("data:-1,model:3", ["3", "8"]),
        ("model:8", ["'data'"]),
        ("data", ["malformed"]),
        ("data:x", ["malformed"]),
        ("data:0", ["malformed"]),
        ("data:-1,model:-1", ["-1"]),
        ("data:2,data:4", ["twice"]),
    ],
)
def test_bad_specs_are_one_line_errors(spec, words):
    with pytest.raises(ss.UsageError) as err:
        ss.make_mesh(spec)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_parse_resolves_minus_one():
    assert parse_mesh_spec("model:2,data:-1", 8) == (("model", "data"), (2, 4))
