"""make_mesh: spec strings to meshes, and clear errors for specs that do not fit."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

import sharded_scan as ss
from sharded_scan.mesh import hybrid_devices, parse_mesh_spec


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


def test_devices_of_several_slices_run_data_slice_by_slice():
    """Stand-ins for 8 TPU devices in 2 slices (CPU devices have one slice): the hybrid layout."""
    devices = [SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 2, platform="cpu", device_kind="cpu")
               for i in range(8)]
    slice_of = np.vectorize(lambda d: d.slice_index)
    mesh = hybrid_devices(devices[::-1], ("data", "model"), (4, 2), "data:4,model:2")
    np.testing.assert_array_equal(slice_of(mesh), [[0, 0], [0, 0], [1, 1], [1, 1]])  # model inside a slice
    mesh = hybrid_devices(devices, ("model", "data"), (2, 4), "model:2,data:4")
    np.testing.assert_array_equal(slice_of(mesh), [[0, 0, 1, 1], [0, 0, 1, 1]])
    assert sorted(d.id for d in mesh.flat) == list(range(8))
    with pytest.raises(ss.UsageError, match="multiple of 2"):
        hybrid_devices(devices, ("data", "model"), (1, 8), "data:1,model:8")
