"""A directory as an object store: ``endpoint_url = "file:///path/to/dir"``.

For machines without an S3 server (the GPU test machine, a laptop) and for shared
filesystems. Keys map to files under the root (``/`` separated, as in S3). Writes go to a
temporary file in the same directory and are published with an atomic rename, so readers see
a whole object or none; ``put(if_absent=True)`` publishes with ``link()``, which fails if the
name exists: a real create-if-absent on POSIX filesystems.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from s3kv.errors import BucketNotFoundError, ConfigError, StorageError
from s3kv.storage.base import Backend, Capabilities, DeleteResult, ObjectInfo, refuse_oversized

__all__ = ["FileBackend", "is_file_url"]

_TMP_PREFIX = ".s3kv-tmp-"


def is_file_url(url: str | None) -> bool:
    """Whether ``url`` (an ``endpoint_url``) names a directory rather than an S3 server."""
    return (url or "").startswith("file://")


def _translate(exc: OSError, op: str, key: str) -> StorageError:
    return StorageError(f"{op} {key!r}: {exc.strerror or exc}")


class FileBackend(Backend):
    """Objects as files below ``root``.

    Args:
        root: The directory playing the bucket; it must exist (like a bucket).
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._caps = Capabilities(conditional_put=True, remote=False)

    @classmethod
    def from_url(cls, url: str) -> FileBackend:
        """Build from ``file:///absolute/path``.

        Raises:
            ConfigError: not a ``file://`` URL with an absolute path.
        """
        if not is_file_url(url) or not url[len("file://") :].startswith("/"):
            raise ConfigError(f"endpoint_url: expected file:///absolute/path, got {url!r}")
        return cls(url[len("file://") :])

    @property
    def capabilities(self) -> Capabilities:
        return self._caps

    @property
    def description(self) -> str:
        return f"file://{self.root}"

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"invalid object key {key!r} for a file backend")
        return self.root.joinpath(*parts)

    def check(self) -> None:
        if not self.root.is_dir():
            raise BucketNotFoundError(
                f"directory {self.root} does not exist: create it or fix TLLM_S3KV_ENDPOINT_URL"
            )

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes | None:
        try:
            with self._path(key).open("rb") as fh:
                refuse_oversized(f"get {key!r}", os.fstat(fh.fileno()).st_size, max_bytes)
                if max_bytes is None:
                    return fh.read()
                # NOTE: bounded even if the file grows after the fstat (a writer that does
                # not publish with a rename).
                data = fh.read(max_bytes + 1)
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as exc:
            raise _translate(exc, "get", key) from exc
        refuse_oversized(f"get {key!r}", len(data), max_bytes)
        return data

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                if if_absent:
                    try:
                        os.link(tmp, path)
                    except FileExistsError:
                        return False
                else:
                    os.replace(tmp, path)
                    tmp = ""
            finally:
                if tmp:
                    os.unlink(tmp)
        except OSError as exc:
            raise _translate(exc, "put", key) from exc
        return True

    def head(self, key: str) -> ObjectInfo | None:
        try:
            stat = self._path(key).stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _translate(exc, "head", key) from exc
        return ObjectInfo(key, stat.st_size, stat.st_mtime, _version_tag(stat))

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        result = DeleteResult()
        for key in keys:
            try:
                self._path(key).unlink()
            except FileNotFoundError:
                pass  # already gone counts as deleted, as in S3
            except OSError as exc:
                result.failed[key] = exc.strerror or str(exc)
                continue
            result.deleted.append(key)
        return result

    def list(self, prefix: str, *, start_after: str | None = None) -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            raise BucketNotFoundError(f"directory {self.root} does not exist")
        found: list[ObjectInfo] = []
        # NOTE: walk only the directory the prefix names: listing the manifest's few objects
        # must not stat every block in the bucket (it runs on every manifest refresh).
        folder = prefix.rpartition("/")[0]
        parts = folder.split("/") if folder else []
        if any(part in ("", ".", "..") for part in parts):
            return
        start = self.root.joinpath(*parts)
        for dirpath, _, filenames in os.walk(start):
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                key = base + name
                if name.startswith(_TMP_PREFIX) or not key.startswith(prefix):
                    continue
                if start_after is not None and key <= start_after:
                    continue
                stat = os.stat(os.path.join(dirpath, name))
                found.append(ObjectInfo(key, stat.st_size, stat.st_mtime, _version_tag(stat)))
        yield from sorted(found, key=lambda info: info.key)

    def list_dirs(self, prefix: str) -> Iterator[str]:
        if prefix and not prefix.endswith("/"):
            yield from super().list_dirs(prefix)
            return
        if not self.root.is_dir():
            raise BucketNotFoundError(f"directory {self.root} does not exist")
        base = self._path(prefix[:-1]) if prefix else self.root
        try:
            names = sorted(entry.name for entry in os.scandir(base) if entry.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise _translate(exc, "list", prefix) from exc
        # NOTE: deleting objects leaves their directories behind; S3 has no empty
        # "directories", so only names with an object below them count.
        yield from (name for name in names if _holds_object(base / name))


def _version_tag(stat: os.stat_result) -> str:
    """An ETag stand-in: every PUT publishes a new file (rename or link), so a new inode."""
    return f"{stat.st_ino:x}-{stat.st_size:x}-{stat.st_mtime_ns:x}"


def _holds_object(directory: Path) -> bool:
    return any(
        not name.startswith(_TMP_PREFIX) for _, _, files in os.walk(directory) for name in files
    )
