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

from s3kv.backend import Backend, Capabilities, DeleteResult, ObjectInfo
from s3kv.errors import BucketNotFoundError, ConfigError, StorageError


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
        if not url.startswith("file://") or not url[len("file://") :].startswith("/"):
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

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            return None
        except OSError as exc:
            raise _translate(exc, "get", key) from exc

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> bool:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".s3kv-tmp-")
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
        return ObjectInfo(key, stat.st_size, stat.st_mtime)

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
        for dirpath, _, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                key = base + name
                if name.startswith(".s3kv-tmp-") or not key.startswith(prefix):
                    continue
                if start_after is not None and key <= start_after:
                    continue
                stat = os.stat(os.path.join(dirpath, name))
                found.append(ObjectInfo(key, stat.st_size, stat.st_mtime))
        yield from sorted(found, key=lambda info: info.key)
