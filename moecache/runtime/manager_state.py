"""A cache manager's session state on disk: save it at the end of a run, start the next run from it.

File format (version 1): an uncompressed `.npz` (numpy's zip of `.npy` arrays, read back with
allow_pickle=False) holding
- `header`: a 0-d unicode array with one JSON object: `format` ("moecache-manager-state"),
  `version` (1), `policy` (the label: name and every parameter), `policy_name`, `params`, `shape`
  ([layers, experts]), `capacity`, `fields` (the policy state's member names, in order) and `clocks`
  (a0, clock, request, step_tokens, last_layer);
- `state.<field>`: each member of the policy's state;
- `resident_keys` (int64): the keys holding a slot.
It is written to a temporary file in the target's folder, flushed to disk, then renamed over the target
(os.replace), so a reader sees the old file or the new one, never a partial one.

`init_manager(manager, path)` starts a manager from either such a file (`load_state`: the same policy,
parameters, shape and capacity, or a one-line error) or a routing trace (a canonical trace Parquet file
or trace artifact folder: `CacheManager.warm_from_trace`, the policy replayed over the trace).

Legend: G global keys.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from moecache.errors import MoecacheError

FORMAT = "moecache-manager-state"
VERSION = 1


def save_state(manager, path) -> Path:
    """Write `manager`'s session state (CacheManager.export_state) to `path`, atomically."""
    exported = manager.export_state()
    policy = manager.policy
    header = {
        "format": FORMAT,
        "version": VERSION,
        "policy": exported["policy"],
        "policy_name": policy.name,
        "params": policy.params,
        "shape": exported["shape"],
        "capacity": exported["capacity"],
        "fields": list(exported["state"]),
        "clocks": exported["clocks"],
    }
    arrays = {f"state.{name}": value for name, value in exported["state"].items()}
    arrays["resident_keys"] = np.asarray(exported["resident_keys"], np.int64)
    arrays["header"] = np.array(json.dumps(header, sort_keys=True, default=str))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def is_state_file(path) -> bool:
    """Whether `path` is a file in this format (any version): a zip holding a `header.npy`."""
    import zipfile

    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return "header.npy" in z.namelist()


def read_state(path) -> dict:
    """The saved state at `path` in export_state's layout (plus `header`); a one-line error for a file
    that is not one, or of another version."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            header = json.loads(str(npz["header"][()]))
            if header.get("format") != FORMAT:
                raise MoecacheError(f"{path}: not a moecache manager state (format {header.get('format')!r})")
            if header.get("version") != VERSION:
                raise MoecacheError(
                    f"{path}: manager state version {header.get('version')!r}; this moecache reads {VERSION}"
                )
            state = {name: npz[f"state.{name}"] for name in header["fields"]}
            resident = npz["resident_keys"]
    except MoecacheError:
        raise
    except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise MoecacheError(f"{path}: cannot read the manager state ({' '.join(str(exc).split())})") from exc
    return {
        "header": header,
        "policy": header["policy"],
        "shape": header["shape"],
        "capacity": header["capacity"],
        "state": state,
        "resident_keys": resident,
        "clocks": header["clocks"],
    }


def load_state(manager, path) -> None:
    """Continue `manager` from the state saved at `path` (same policy and parameters, model shape and
    capacity; every state member of the same dtype and shape)."""
    saved = read_state(path)
    ours = manager.state
    if tuple(saved["state"]) != ours._fields:
        raise MoecacheError(
            f"{path}: state members {list(saved['state'])}, policy {manager.policy.label()} has {list(ours._fields)}"
        )
    for key in ("policy", "shape", "capacity"):
        have = {
            "policy": manager.policy.label(),
            "shape": [manager.shape.num_layers, manager.shape.num_experts],
            "capacity": manager.capacity,
        }[key]
        if saved[key] != have:
            raise MoecacheError(f"{path}: saved {key} {saved[key]!r}, this manager has {have!r}")
    for name, value in saved["state"].items():
        mine = getattr(ours, name)
        if value.dtype != mine.dtype or value.shape != mine.shape:
            raise MoecacheError(
                f"{path}: state member {name} is {value.dtype}{list(value.shape)}, expected {mine.dtype}{list(mine.shape)}"
            )
    manager.import_state(saved)


def init_manager(manager, path) -> str:
    """Start `manager` from `path`: a saved state ("state") or a routing trace ("trace", the policy
    replayed over it). Returns which."""
    path = Path(path)
    if is_state_file(path):
        load_state(manager, path)
        return "state"
    if path.is_dir() or path.suffix == ".parquet":
        from moecache.sim.trace_arrays import load_trace

        file = path / "trace.parquet" if path.is_dir() else path
        if not file.is_file():
            raise MoecacheError(f"runtime.init={path}: no trace there (expected a trace.parquet)")
        manager.warm_from_trace(load_trace(file))
        return "trace"
    raise MoecacheError(
        f"runtime.init={path}: neither a saved manager state (.npz) nor a trace (.parquet or an artifact folder)"
    )
