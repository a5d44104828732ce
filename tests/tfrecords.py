"""TensorBoard scalars read back from event files, for the tests of ``launch.metrics``.

A small reader of the TFRecord framing (no TensorFlow; CRCs not checked); tensorboardX
(installed with ``sharded_scan[metrics]``) provides the protobuf, and has no reader of its own.
"""

from __future__ import annotations

import glob
import os
import struct


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """The scalars of every event file in ``logdir``: ``{tag: [(step, value), ...]}`` in file order."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(glob.glob(os.path.join(os.fspath(logdir), "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        at = 0
        while at + 12 <= len(data):  # a record: length (8 bytes), its CRC (4), the data, its CRC (4)
            (length,) = struct.unpack_from("<Q", data, at)
            record = data[at + 12:at + 12 + length]
            at += 12 + length + 4
            event = Event.FromString(record)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return scalars
