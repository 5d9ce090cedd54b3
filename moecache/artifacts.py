"""Versioned, atomically written stage artifacts: `outputs/<stage>/<artifact-id>/manifest.json`.

An artifact id is derived from the stage, its schema version, the part of the resolved config that
determines the result, the ids of its input artifacts and a fingerprint of the code that computes it
(`code_fingerprint`), so an identical re-run of the same code finds (and by default reuses) the same id,
and a code change never silently reuses a result of the old code (docs/artifacts.md). Files are written into a hidden temporary folder beside the final one
and renamed into place only once everything, the manifest last, is on disk: an interrupted run
leaves no artifact. While that folder exists, SIGTERM and SIGHUP raise (as SIGINT does) so that the
folder is removed before the process exits; a folder left by a process that could not clean up (SIGKILL,
power loss) is removed by the next `create` in the same stage folder once its owner is known to be gone.
The manifest records every file's size and sha256, and an artifact is read only after its manifest and
files have been checked against each other (`check_artifact`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from moecache.env_info import git_commit, machine_info, package_versions
from moecache.errors import MoecacheError

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
STALE_MARK = "stale-"  # .tmp-stale-<id>-...: a replaced artifact on its way out (a forced re-run)
# A temporary folder's name: .tmp-[stale-]<artifact id>-<owner tag>-<pid>-<random>. The owner tag
# identifies the host and PID namespace, so that a PID is only ever looked up where it means something.
TMP_NAME = re.compile(
    rf"^{re.escape(TMP_PREFIX)}(?P<stale>{STALE_MARK})?(?P<aid>[a-z_]+-[0-9a-f]{{12}})"
    r"-(?P<owner>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]{8}$"
)
# The signals whose default action ends the process without running Python clean-up: while a temporary
# folder exists they raise `Terminated`, as SIGINT raises KeyboardInterrupt.
TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
INTERRUPTS = (signal.SIGINT, *TERMINATING_SIGNALS)


def default_output_root() -> str:
    """Where artifacts go when no output_root is given: $MOECACHE_OUTPUT_ROOT, else `outputs` (as the
    configs' `output_root` default)."""
    return os.environ.get("MOECACHE_OUTPUT_ROOT", "outputs")


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def config_hash(config: dict) -> str:
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()


# The packages whose source computes artifacts: moecache and the expert kernels (kernels/ installs as
# moecache_kernels). conf/ is not hashed here: the part of the config that matters is in the id already.
FINGERPRINT_PACKAGES = ("moecache", "moecache_kernels")


def source_files(packages: tuple[str, ...] = FINGERPRINT_PACKAGES) -> list[tuple[str, bytes]]:
    """(package-relative path, bytes) of every file of `packages` (the .py source and the bundled data,
    such as moecache/data/cost_profiles/; compiled __pycache__ left out), sorted by path. The packages
    are located, not imported, so fingerprinting costs no import time."""
    files = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for location in spec.submodule_search_locations:
            root = Path(location)
            for p in root.rglob("*"):
                if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
                    files.append((f"{name}/{p.relative_to(root).as_posix()}", p.read_bytes()))
    return sorted(files)


def fingerprint_of(files: list[tuple[str, bytes]]) -> str:
    """sha256 over the sorted (path, length, bytes) of `files`: a change of any byte, a renamed, added
    or removed file changes it."""
    digest = hashlib.sha256()
    for path, data in sorted(files):
        digest.update(path.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()


@functools.cache
def code_fingerprint() -> str:
    """The fingerprint of the installed moecache code and data, computed once per process
    (docs/artifacts.md)."""
    return fingerprint_of(source_files())


def artifact_id(stage: str, schema_version: int, config: dict, inputs: list[str]) -> str:
    key = canonical_json(
        {
            "stage": stage,
            "schema": schema_version,
            "config": config,
            "inputs": inputs,
            "code": code_fingerprint(),
        }
    )
    return f"{stage}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to `path` through a temporary file and a rename."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class Terminated(SystemExit):
    """Raised by SIGTERM or SIGHUP while an artifact is being written; exits with 128 + the signal's
    number, the status the default action would have given."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signum)


@contextmanager
def terminating_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Terminated` inside the block, where they still have their default
    action (a handler someone installed is left alone). Only the main thread can install handlers; in
    another one the signals keep killing the process and the next run removes what it left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed = {}
    for signum in TERMINATING_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            installed[signum] = signal.signal(signum, _raise_terminated)
    try:
        yield
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back (delivered when the block ends), so that a step that must
    not be cut in half (publishing, cleaning up) is not."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, INTERRUPTS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@functools.cache
def owner_tag() -> str:
    """8 hex digits naming this host and PID namespace (a container sharing the host's network, and so
    its hostname, has PIDs of its own)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def _boot_time() -> float | None:
    """When this machine booted (Linux), or None."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _owner_gone(path: Path, pid: int) -> bool:
    """Whether the process that made the temporary folder `path` (on this host) has ended: no process
    has its PID, or the folder is older than the last boot. A PID taken again by another process reads
    as alive: the folder is kept, which is safe."""
    boot = _boot_time()
    try:
        if boot is not None and path.stat().st_mtime < boot:
            return True
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # a live process of another user
    return False


def remove_stale(stage_dir: Path) -> list[Path]:
    """Remove the temporary folders in `stage_dir` whose owner on this host has ended (killed before it
    could clean up). A replaced artifact caught between the two renames of a forced re-run (SIGKILL)
    is put back where its artifact is missing. Folders of other hosts and of live processes, and folders
    named in an older format, are left alone (they are never listed or read). Returns what was removed."""
    removed = []
    try:
        entries = list(stage_dir.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = TMP_NAME.match(path.name)
        if match is None or match["owner"] != owner_tag() or int(match["pid"]) == os.getpid():
            continue
        if not _owner_gone(path, int(match["pid"])):
            continue
        final = stage_dir / match["aid"]
        if match["stale"] and not final.exists() and (path / MANIFEST).is_file():
            try:
                os.rename(path, final)
                continue
            except OSError:
                pass  # another run published it meanwhile
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def tmp_name(aid: str, stale: bool = False) -> str:
    return (
        f"{TMP_PREFIX}{STALE_MARK if stale else ''}{aid}-{owner_tag()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )


def read_manifest(path: Path) -> dict:
    """A manifest.json as a dict; a damaged one is one clear error naming the file."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MoecacheError(f"{path}: not a readable manifest ({' '.join(str(exc).split())})") from exc
    if not isinstance(manifest, dict):
        raise MoecacheError(f"{path}: not a readable manifest (a JSON object expected)")
    return manifest


def _digests(folder: Path, files: list[str]) -> dict:
    return {
        name: {"bytes": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
        for name in files
    }


# Artifacts whose contents this process has checked (or written), keyed by their folder and the size and
# modification time of every file: each is hashed once per process, however many stages of it read it,
# and again once any of its files changes.
_CHECKED: set[tuple] = set()


def _stamp(path: Path, files: list[str]) -> tuple:
    stats = [(path / name).stat() for name in [MANIFEST, *files]]
    return (str(path.resolve()), *((st.st_size, st.st_mtime_ns) for st in stats))


def check_artifact(path: Path, contents: bool = True) -> dict:
    """The manifest of the artifact folder `path`, after checking that it is one: a readable manifest
    naming its id and stage, and every file it lists present, with the size (and, with `contents`, the
    sha256) it records. A failure is one MoecacheError naming the folder and what is wrong."""
    try:
        manifest = read_manifest(path / MANIFEST)
    except MoecacheError as exc:  # the stage is then only the folder's guess, for the hint
        raise MoecacheError(f"{exc}; {_recompute_hint(path.parent.name)}") from exc
    aid, stage = manifest.get("artifact_id"), manifest.get("stage")
    if not (
        isinstance(aid, str)
        and isinstance(stage, str)
        and re.fullmatch(rf"{re.escape(stage)}-[0-9a-f]{{12}}", aid)
    ):
        raise _damaged(path, stage, f"its {MANIFEST} names no artifact_id and stage ({aid!r}, {stage!r})")
    files, digests = manifest.get("files"), manifest.get("file_digests", {})
    if (
        not isinstance(files, list)
        or not all(isinstance(f, str) for f in files)
        or not isinstance(digests, dict)
    ):
        raise _damaged(path, stage, f"its {MANIFEST} has no list of files")
    for name in files:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise _damaged(path, stage, f"its {MANIFEST} lists {name!r}, a file outside the artifact")
        if not (path / name).is_file():
            raise _damaged(path, stage, f"{name} is missing")
        want = digests.get(name)
        if want is None:
            continue  # an artifact written before sizes and hashes were recorded
        size = (path / name).stat().st_size
        if size != want.get("bytes"):
            raise _damaged(path, stage, f"{name} has {size} bytes, its manifest records {want.get('bytes')}")
    if contents and digests:
        stamp = _stamp(path, files)
        if stamp not in _CHECKED:
            for name in files:
                want = digests.get(name)
                if want is not None and file_sha256(path / name) != want.get("sha256"):
                    raise _damaged(path, stage, f"{name} does not match the sha256 its manifest records")
            _CHECKED.add(stamp)
    return manifest


def _recompute_hint(stage) -> str:
    command = stage.replace("_", "-") if isinstance(stage, str) and stage else "<stage>"
    return f"recompute it (`moecache {command} ... force=true`) or remove it"


def _damaged(path: Path, stage, reason: str) -> MoecacheError:
    return MoecacheError(f"{path}: damaged artifact: {reason}; {_recompute_hint(stage)}")


@dataclass(frozen=True)
class Artifact:
    """A finished artifact on disk. Its id and stage are its manifest's, wherever the folder is."""

    path: Path

    @property
    def id(self) -> str:
        return self._named("artifact_id", self.path.name)

    @property
    def manifest(self) -> dict:
        return read_manifest(self.path / MANIFEST)

    @property
    def stage(self) -> str:
        return self._named("stage", self.path.parent.name)

    def _named(self, key: str, folder_guess: str) -> str:
        """The manifest's `key`; where the manifest cannot say (damaged), the folder's name, good only
        for naming the artifact in a message: `check_artifact` refuses such an artifact before use."""
        try:
            value = self.manifest.get(key)
        except MoecacheError:
            return folder_guess
        return value if isinstance(value, str) else folder_guess

    def checked(self, contents: bool = True) -> Artifact:
        """This artifact, once `check_artifact` has passed."""
        check_artifact(self.path, contents)
        return self


class ArtifactStore:
    """The folder of all artifacts (`outputs/` by default)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def find(self, artifact_id: str) -> Artifact | None:
        """The folder published under this id, unchecked (None if there is none)."""
        stage = artifact_id.rsplit("-", 1)[0]
        path = self.root / stage / artifact_id
        if (path / MANIFEST).is_file():
            return Artifact(path)
        return None

    def get(self, artifact_id: str, contents: bool = True) -> Artifact:
        """The artifact with this id, checked (`check_artifact`); its manifest must name the same id."""
        found = self.find(artifact_id)
        if found is None:
            raise MoecacheError(
                f"no artifact '{artifact_id}' under {self.root}/ (see `moecache artifacts list`)"
            )
        manifest = check_artifact(found.path, contents)
        if manifest["artifact_id"] != artifact_id:
            raise _damaged(
                found.path, manifest["stage"], f"its {MANIFEST} is that of {manifest['artifact_id']}"
            )
        return found

    def resolve(self, ref: str, contents: bool = True) -> Artifact:
        """An artifact given by id or by path to its folder (anywhere), checked."""
        path = Path(ref)
        if (path / MANIFEST).is_file():
            return Artifact(path).checked(contents)
        if path.exists():
            raise MoecacheError(f"{path} is not an artifact folder: it has no {MANIFEST}")
        return self.get(ref, contents)

    def folders(self, stage: str | None = None) -> list[Path]:
        """Every published artifact folder (one holding a manifest.json), readable or not."""
        if not self.root.is_dir():
            return []
        stages = [self.root / stage] if stage else sorted(p for p in self.root.iterdir() if p.is_dir())
        found = []
        for stage_dir in stages:
            if not stage_dir.is_dir() or stage_dir.name.startswith("."):
                continue
            for path in sorted(stage_dir.iterdir()):
                if not path.name.startswith(TMP_PREFIX) and (path / MANIFEST).is_file():
                    found.append(path)
        return found

    def list(self, stage: str | None = None) -> list[Artifact]:
        """Every artifact, oldest first. One with a damaged manifest is skipped with a one-line warning
        on stderr naming it, so that one bad folder does not hide (or break) all the others."""
        found = []
        for path in self.folders(stage):
            try:
                found.append((read_manifest(path / MANIFEST).get("created_at", ""), Artifact(path)))
            except MoecacheError as exc:
                print(f"moecache: warning: skipping {exc}", file=sys.stderr)
        return [art for _, art in sorted(found, key=lambda pair: str(pair[0]))]

    def resolve_prefix(self, ref: str) -> Artifact:
        """An artifact given by path, whole id or a unique prefix of its id."""
        path = Path(ref)
        if (path / MANIFEST).is_file() or path.exists() or self.find(ref) is not None:
            return self.resolve(ref, contents=False)
        matches = [p for p in self.folders() if p.name.startswith(ref)]
        if len(matches) == 1:
            return Artifact(matches[0])
        if not matches:
            raise MoecacheError(f"no artifact '{ref}' under {self.root}/ (see `moecache artifacts list`)")
        raise MoecacheError(f"'{ref}' is ambiguous: {', '.join(p.name for p in matches)}")

    def latest(self, stage: str) -> Artifact | None:
        """The newest artifact of `stage`, checked; None if there is none."""
        found = self.list(stage)
        return found[-1].checked() if found else None

    @contextmanager
    def create(
        self,
        stage: str,
        *,
        schema_version: int,
        config: dict,
        inputs: list[str],
        seed: int | None,
        extra: dict | None = None,
    ) -> Iterator[Path]:
        """Yield a temporary folder to fill; on success it becomes `<root>/<stage>/<id>/`.

        On any exception, and on SIGINT, SIGTERM or SIGHUP, the temporary folder is removed and nothing
        is published (module docstring); temporary folders of ended processes are removed first.
        """
        aid = artifact_id(stage, schema_version, config, inputs)
        final = self.root / stage / aid
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(final.parent)
        tmp = final.parent / tmp_name(aid)
        with terminating_signals_raise():
            try:
                tmp.mkdir()
                yield tmp
                self._publish(tmp, final, stage, schema_version, config, inputs, seed, extra)
            except BaseException:
                with _signals_deferred():
                    shutil.rmtree(tmp, ignore_errors=True)
                raise

    def _publish(self, tmp: Path, final: Path, stage: str, schema_version: int, config: dict,
                 inputs: list[str], seed: int | None, extra: dict | None) -> None:  # fmt: skip
        """Write the manifest into the filled folder `tmp` and rename it to `final`."""
        aid = final.name
        manifest = {
            "artifact_id": aid,
            "stage": stage,
            "schema_version": schema_version,
            "config": config,
            "config_hash": config_hash(config),
            "inputs": list(inputs),
            "seed": seed,
            "code_fingerprint": code_fingerprint(),
            "versions": package_versions(),
            "git_commit": git_commit(),
            "machine": machine_info(),
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        if extra:
            manifest.update(extra)
        files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
        manifest["files"] = files
        manifest["file_digests"] = _digests(tmp, files)
        write_json_atomic(tmp / MANIFEST, manifest)
        with _signals_deferred():  # both renames, or (on an error) neither
            if final.exists():  # a forced re-run replaces the old artifact
                stale = final.parent / tmp_name(aid, stale=True)
                os.rename(final, stale)
                try:
                    os.rename(tmp, final)
                except BaseException:
                    os.rename(stale, final)
                    raise
                shutil.rmtree(stale, ignore_errors=True)
            else:
                os.rename(tmp, final)
        _CHECKED.add(_stamp(final, files))
