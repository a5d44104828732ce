"""What every job config shares: run options, checkpointing, logging, the quick variant."""

from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections import config_dict

from launch.data import data_config
from sharded_scan.options import config_fields

VARIANTS = ("full", "quick")
# What the fields below mean where neither RunOptions nor CheckpointOptions documents them (``--help`` prints them).
FIELD_HELP = {
    "x64": "jax_enable_x64 for the whole process; data needs no flag: 64-bit data (float64, int64) and 32-bit "
           "integers are reduced in 64 bits either way where the backend has float64",
    "checkpoint.enabled": "save checkpoints in DIR/checkpoints and resume from them (false: a rerun starts afresh)",
    "log_every_seconds": "seconds between progress lines in the log",
}


def base_config(
    combiner: str, kwargs: dict[str, Any] | None, arg: str | None, *, num_rows: int, features: int,
    targets: bool = False,
) -> ml_collections.ConfigDict:
    """A job config. ``arg`` is ``None``/``"full"`` or ``"quick"`` (a tiny run for tests)."""
    variant = arg or "full"
    if variant not in VARIANTS:
        raise ValueError(f"unknown config variant {arg!r}; use one of {VARIANTS}.")
    quick = variant == "quick"
    c = ml_collections.ConfigDict()
    c.combiner = ml_collections.ConfigDict({"name": combiner, "kwargs": dict(kwargs or {})})
    c.data = data_config(1000 if quick else num_rows, features, targets=targets)
    for name, (default, kind) in config_fields().items():  # the run options, with the engine's defaults
        c[name] = config_dict.placeholder(kind) if default is None else default
    if quick:
        c.microbatch, c.steps_per_call = 16, 2
    c.x64 = False  # jax_enable_x64 for the whole process (64-bit data is reduced in 64 bits without it)
    c.checkpoint = ml_collections.ConfigDict(
        {
            "enabled": True,
            "every_steps": config_dict.placeholder(int),
            "every_seconds": 600.0,
            "keep": 2,
            "per_job": config_dict.placeholder(int),  # at most about this many step-based saves over the job
            "ignore_changed_data": False,  # resume although a data file changed since the checkpoint
            "verify_data": "stamps",  # or "digest": also every input file's SHA-256 (one more read of the data)
            "compact": False,  # one merged state a save (about one state, resume to float rounding), not every shard's
        }
    )
    if quick:  # a save every 2 steps, but only a handful over the job, whatever its size
        c.checkpoint.every_steps, c.checkpoint.per_job = 2, 4
    c.log_every_seconds = 10.0
    return c
