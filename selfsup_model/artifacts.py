"""Atomic file writes, hashing and stage manifests.

Every artifact is written to a temporary name in its final directory and moved
into place with `os.replace`, so a reader sees either the old file or the new
one, never half of one. A stage's `manifest.json` is written last: a directory
without a valid manifest is never trusted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from selfsup_model.errors import ArtifactError, DiskFullError

MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


def current_umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; move it into place only on success."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    # mkstemp makes the file 0600; the replaced file gets what open() would give it under the
    # umask, so a model's spec and tokenizer are as readable as the weights beside them.
    os.fchmod(fd, 0o666 & ~current_umask())
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with _disk_full_named(final, tmp_path):
            yield tmp_path
            with open(tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp_path, final)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


# What `atomic_path` names its temporary files: "." + the file's name + mkstemp's 8 characters;
# and `save_keras_atomic` its scratch model: "." + the stem + ".tmp" + a pid + ".keras".
_TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")
_KERAS_SCRATCH = re.compile(r"^\..+\.tmp\d+\.keras$")


def remove_temporaries(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files `atomic_path` and `save_keras_atomic` leave when their process
    is killed mid-write (a SIGKILL runs no cleanup) anywhere under `directory`; the paths
    removed."""
    stale = [p for p in Path(directory).rglob(".*") if p.is_file()
             and (_TEMPORARY.match(p.name) or _KERAS_SCRATCH.match(p.name))]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def _disk_full_named(final: Path, tmp: Path) -> Iterator[None]:
    """Turn "no space left" (or quota) while writing `tmp` into one DiskFullError naming the
    file, what it had written and the space left, instead of a library's traceback."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _NO_SPACE and "No space left on device" not in str(exc):
            raise
        written = tmp.stat().st_size if tmp.exists() else 0
        free = shutil.disk_usage(final.parent).free
        raise DiskFullError(
            f"no space left to write {final}: it needs more than the {written:,} bytes written "
            f"when the device filled, and {free:,} bytes are free there; free some space and "
            "rerun (completed stages are kept, this one reruns)") from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True,
                                              default=_json_default) + "\n")


def atomic_save_npy(path: str | os.PathLike, array: Any) -> Path:
    """np.save atomically, without pickle (through a handle: np.save(path) appends '.npy')."""
    import numpy as np  # here, so that manifests and JSON need no numpy

    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        np.save(fh, np.ascontiguousarray(array), allow_pickle=False)
    return Path(path)


def atomic_write_parquet(path: str | os.PathLike, frame: Any) -> Path:
    """A pandas DataFrame as Parquet, atomically, without its index."""
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)
    return Path(path)


def save_keras_atomic(model: Any, path: str | os.PathLike) -> Path:
    """`model.save` to a scratch `.keras` name beside `path`, then into place atomically as
    reproducible bytes (`_reproducible_keras`): the same model saves to the same file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.stem}.tmp{os.getpid()}.keras")  # save() insists on .keras
    try:
        with _disk_full_named(path, scratch):
            model.save(scratch)
        with atomic_path(path) as tmp:
            _reproducible_keras(scratch, tmp)
    finally:
        scratch.unlink(missing_ok=True)
    return path


# What a .keras archive holds that is not the model: its save time (metadata.json and the
# weights' zip entry) and the memory address of each shared object (config.json's
# shared_object_id, which only pairs references within the file). Stage manifests record when.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
_SAVED_AT = "1980-01-01@00:00:00"


def _renumber_shared(node: Any, ids: dict[int, int]) -> Any:
    if isinstance(node, dict):
        return {k: (ids.setdefault(v, len(ids) + 1) if k == "shared_object_id"
                    else _renumber_shared(v, ids)) for k, v in node.items()}
    if isinstance(node, list):
        return [_renumber_shared(v, ids) for v in node]
    return node


def _reproducible_keras(source: Path, dest: Path) -> None:
    """Copy the Keras archive `source` to `dest` without what varies between saves of one
    model: entry times fixed, date_saved fixed, shared object ids numbered in order of first
    appearance. Members are streamed, so the weights are never held in memory."""
    import zipfile

    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(dest, "w") as zout:
        for info in zin.infolist():
            entry = zipfile.ZipInfo(info.filename, date_time=_ZIP_EPOCH)
            entry.compress_type, entry.external_attr = info.compress_type, info.external_attr
            if info.filename in ("config.json", "metadata.json"):
                doc = json.loads(zin.read(info))
                if info.filename == "metadata.json":
                    doc["date_saved"] = _SAVED_AT
                zout.writestr(entry, json.dumps(_renumber_shared(doc, {})))
                continue
            with zin.open(info) as src, zout.open(entry, "w",
                                                  force_zip64=info.file_size >= 1 << 31) as dst:
                shutil.copyfileobj(src, dst, _CHUNK)


def _json_default(obj: Any) -> Any:
    # numpy scalars and paths turn up in counts; everything else is a bug.
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


_HASHES: dict[tuple[str, int, int], str] = {}


def cached_sha256(path: str | os.PathLike) -> str:
    """sha256 of a file, memoised on (path, size, mtime) within this process."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(path)
    return _HASHES[key]


def sha256_arrays(arrays: list[Any]) -> str:
    """One digest of arrays' shapes, dtypes and bytes, in order."""
    import numpy as np

    digest = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(f"{a.dtype.str}{a.shape}".encode())
        digest.update(a.tobytes())
    return digest.hexdigest()


def sha256_json(obj: Any) -> str:
    """Stable hash of a JSON-able object (sorted keys), for parameter fingerprints."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class FileRecord:
    sha256: str
    size: int


@dataclasses.dataclass(frozen=True)
class StageManifest:
    """What a finished stage read, how it was configured, and what it wrote."""

    stage: str
    code_version: str
    params: dict[str, Any]
    inputs: dict[str, str]  # artifact key ("stage/file") -> sha256
    outputs: dict[str, FileRecord]  # file name relative to the stage dir -> record
    counts: dict[str, Any]
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    started_at: str = ""
    finished_at: str = ""
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["outputs"] = {k: dataclasses.asdict(v) for k, v in self.outputs.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageManifest:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ArtifactError(f"manifest has unknown fields {sorted(unknown)}")
        data = dict(data)
        data["outputs"] = {k: FileRecord(**v) for k, v in data["outputs"].items()}
        return cls(**data)

    def write(self, stage_dir: str | os.PathLike) -> Path:
        return atomic_write_json(Path(stage_dir) / MANIFEST_NAME, self.to_dict())

    @classmethod
    def read(cls, path: str | os.PathLike) -> StageManifest:
        """The manifest at `path`; an unreadable one is an ArtifactError naming the file."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text("utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ArtifactError(f"cannot read manifest {path} ({exc}); rerun that stage") from None


def read_manifest(stage_dir: str | os.PathLike) -> StageManifest | None:
    """The stage's manifest, or None when absent or unreadable (never trusted then)."""
    try:
        return StageManifest.read(Path(stage_dir) / MANIFEST_NAME)
    except ArtifactError:
        return None


def record_outputs(stage_dir: str | os.PathLike, names: list[str]) -> dict[str, FileRecord]:
    stage_dir = Path(stage_dir)
    out = {}
    for name in sorted(names):
        path = stage_dir / name
        out[name] = FileRecord(sha256=sha256_file(path), size=path.stat().st_size)
    return out


def verify_outputs(stage_dir: str | os.PathLike, manifest: StageManifest,
                   hasher: Callable[[Path], str] = sha256_file) -> list[str]:
    """Names of recorded outputs that are missing or whose bytes changed.

    `hasher` lets a caller memoise hashes (the stage runner checks the same
    files several times per run); the size is compared first, for free.
    """
    stage_dir = Path(stage_dir)
    bad = []
    for name, rec in manifest.outputs.items():
        path = stage_dir / name
        if not path.is_file() or path.stat().st_size != rec.size or hasher(path) != rec.sha256:
            bad.append(name)
    return bad
