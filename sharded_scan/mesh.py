"""Turns a mesh spec such as ``"data:8"`` or ``"data:4,model:2"`` into a JAX Mesh."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from sharded_scan.errors import UsageError

_log = logging.getLogger(__name__)

DATA_AXIS = "data"
MODEL_AXIS = "model"


def parse_mesh_spec(spec: str, num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Parses ``"name:size,..."`` into axis names and sizes, resolving one ``-1``.

    Args:
      spec: comma-separated ``name:size`` pairs; one size may be ``-1`` meaning
        "all the devices the other axes leave".
      num_devices: how many devices are available.

    Returns:
      ``(names, sizes)`` with every size positive and their product at most
      ``num_devices`` (exactly, when a size was ``-1``).

    Raises:
      UsageError: the spec is malformed, lacks a ``data`` axis, or does not fit.
    """
    names: list[str] = []
    sizes: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        name, sep, size = part.partition(":")
        name = name.strip()
        try:
            value = int(size)
        except ValueError:
            value = 0
        if not sep or not name.isidentifier() or value == 0 or value < -1:
            raise UsageError(
                f"mesh spec {spec!r} is malformed at {part!r}: write name:size pairs "
                "such as 'data:8', 'data:-1' or 'data:4,model:2'."
            )
        if name in names:
            raise UsageError(f"mesh spec {spec!r} names axis {name!r} twice.")
        names.append(name)
        sizes.append(value)
    if DATA_AXIS not in names:
        raise UsageError(f"mesh spec {spec!r} has no 'data' axis; rows are split over 'data'.")
    if sizes.count(-1) > 1:
        raise UsageError(f"mesh spec {spec!r} has more than one -1; at most one axis can be inferred.")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise UsageError(
                f"mesh spec {spec!r} does not fit {num_devices} devices: the fixed axes "
                f"({known}) do not divide the device count."
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) > num_devices:
        raise UsageError(
            f"mesh spec {spec!r} needs {math.prod(sizes)} devices but {num_devices} are "
            "present; use 'data:-1' for all of them, or change the sizes."
        )
    return tuple(names), tuple(sizes)


def make_mesh(spec: str | Mesh | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a mesh from a spec string, using all devices (of every process).

    Args:
      spec: e.g. ``"data:-1"`` (the default: every device on one ``data`` axis),
        ``"data:8"`` or ``"data:4,model:2"``. A ``Mesh`` is returned unchanged.
      devices: the devices to use; all of ``jax.devices()`` by default.

    Returns:
      A ``jax.sharding.Mesh`` with Auto axis types. A spec smaller than the devices
      present uses the first ones (single process only; a warning says so). Devices of
      several TPU slices (joined over DCN) get a hybrid mesh: ``data`` spans the slices,
      the other axes stay inside each one (:func:`hybrid_devices`).

    Raises:
      UsageError: the spec is malformed or does not match the devices present.
    """
    if isinstance(spec, Mesh):
        if DATA_AXIS not in spec.axis_names:
            raise UsageError(f"mesh axes {spec.axis_names} have no 'data' axis; rows are split over 'data'.")
        return spec
    devices = list(jax.devices() if devices is None else devices)
    spec = spec or f"{DATA_AXIS}:-1"
    names, sizes = parse_mesh_spec(spec, len(devices))
    used = math.prod(sizes)
    if used < len(devices):
        if jax.process_count() > 1:
            raise UsageError(
                f"mesh spec {spec!r} uses {used} of {len(devices)} devices; with several "
                "processes the mesh must use every device: try 'data:-1'."
            )
        _log.warning("mesh %r uses %d of the %d devices present.", spec, used, len(devices))
        devices = devices[:used]
    axis_types = (AxisType.Auto,) * len(names)
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:  # jax.make_mesh refuses several slices
        return Mesh(hybrid_devices(devices, names, sizes, spec), names, axis_types=axis_types)
    return jax.make_mesh(sizes, names, axis_types=axis_types, devices=devices)


def hybrid_devices(devices: Sequence, names: Sequence[str], sizes: Sequence[int], spec: str) -> np.ndarray:
    """The device array of a mesh over several slices: slice by slice along ``data`` (the one
    axis whose only collective is the final merge, which crosses the slower network once),
    each slice's devices laid out by ``jax.experimental.mesh_utils`` for its own network.

    Raises:
      UsageError: ``data`` is not a multiple of the slice count.
    """
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    i = list(names).index(DATA_AXIS)
    if sizes[i] % slices:
        raise UsageError(
            f"mesh spec {spec!r}: the devices span {slices} slices, so the 'data' axis ({sizes[i]}) must be a "
            f"multiple of {slices} (the other axes stay inside one slice); try 'data:-1'."
        )
    inside, across = list(sizes), [1] * len(sizes)
    inside[i], across[i] = sizes[i] // slices, slices
    return mesh_utils.create_hybrid_device_mesh(inside, across, list(devices))
