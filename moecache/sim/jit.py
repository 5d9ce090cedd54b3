"""Compiled entry points of the simulator, one per (driver, policy), cached on disk by source fingerprint.

Why this module exists. numba keys the disk cache of a function that takes a dispatcher as an argument
by the dispatcher's per-process id (numba #2956), so a replay driver taking the policy's `step` would be
compiled again in every process, ~1 s per (driver, policy) pair. Instead a driver is one plain
module-level function whose policy is fixed by the *type* of its state: every policy's state is a
named tuple of its own class (`Policy.State`), and `visit.call_step` resolves that class to the
policy's `step` at compile time. The signature holds only stable types, so numba can cache it.

`bound(py_func, policy_cls)` gives the dispatcher of `py_func` for one policy class (made once per
process, thread-safe). For a registered policy it is cached on disk under numba's usual cache folder,
in an index of its own (`<driver>-<policy module>.<class>`), so that an index never names the state
class of another policy (loading an index unpickles every key in it) and concurrent processes
compiling different policies do not rewrite each other's index. Unregistered policies (a test's) are
compiled per process.

Staleness. numba stamps a cache with the mtime and size of the function's own file only, so an edit
to a policy's `step`, or to a helper it calls in another file, would leave a driver's cached code
stale. These entry points are stamped instead with `source_fingerprint()`, a hash of every file
they are compiled from (COMPILED_SOURCES: the drivers, visit.py, every policy and its helpers): any
edit there recompiles them. The steps themselves are not cached on disk for that reason; they are
compiled, once per process, only when a driver is.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from functools import cache
from pathlib import Path

import numba as nb
from numba.core.caching import FunctionCache, IndexDataCacheFile

SIM_ROOT = Path(__file__).resolve().parent
PACKAGE_ROOT = SIM_ROOT.parent
# What every entry point is compiled with: no reference counting (every buffer comes from the caller;
# see policies/lfu.py) and the GIL released (the sweep runs replays on a thread pool).
ENTRY_OPTIONS = {"nogil": True, "_nrt": False}


# The files the compiled entry points are made of (relative to the package): the drivers (the cache
# manager's visit too), the visit and every policy with its helpers. A compiled helper added elsewhere
# must be added here.
COMPILED_SOURCES = (
    "sim/jit.py", "sim/visit.py", "sim/replay.py", "sim/timed.py", "sim/policies/*.py",
    "runtime/manager_visit.py",
)  # fmt: skip


@cache
def source_fingerprint() -> str:
    """sha256 of the relative path and bytes of every file of COMPILED_SOURCES, in path order."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in COMPILED_SOURCES for p in PACKAGE_ROOT.glob(pattern)}):
        digest.update(path.relative_to(PACKAGE_ROOT).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


class FingerprintCache(FunctionCache):
    """numba's per-function disk cache, with its own index per `tag` and stamped with the
    simulator's source fingerprint instead of the function file's mtime and size."""

    def __init__(self, py_func, tag: str):
        super().__init__(py_func)
        self._cache_file = IndexDataCacheFile(
            cache_path=self._cache_path,
            filename_base=f"{self._impl.filename_base}-{tag}",
            source_stamp=("moecache.sim", source_fingerprint()),
        )


_LOCK = threading.Lock()
_BOUND: dict[tuple, object] = {}


def cache_tag(policy_cls: type) -> str | None:
    """The disk-cache tag of a policy class: `<module>.<qualname>` for a registered policy, or a
    subclass of one kept under that name in its module (an admission filter over another base,
    policies/_wrap.py): its state class can be found again by name in another process. None otherwise
    (no disk cache)."""
    from moecache.sim.policy import POLICIES

    registered = POLICIES.get(getattr(policy_cls, "name", None))
    if registered is not policy_cls:
        module = sys.modules.get(policy_cls.__module__)
        if (
            registered is None
            or not issubclass(policy_cls, registered)
            or getattr(module, policy_cls.__qualname__, None) is not policy_cls
        ):
            return None
    return f"{policy_cls.__module__}.{policy_cls.__qualname__}".replace("<", "").replace(">", "")


def bound(py_func, policy_cls: type):
    """The compiled dispatcher of `py_func` (a module-level driver) for `policy_cls`. Call it with the
    state made by `Policy.named_state`, which binds the policy's step to its state class."""
    key = (py_func, policy_cls)
    with _LOCK:
        dispatcher = _BOUND.get(key)
        if dispatcher is None:
            dispatcher = nb.njit(**ENTRY_OPTIONS)(py_func)
            tag = cache_tag(policy_cls)
            if tag is not None:
                dispatcher._cache = FingerprintCache(dispatcher.py_func, tag)
            _BOUND[key] = dispatcher
    return dispatcher
