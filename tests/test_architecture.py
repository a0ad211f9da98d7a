"""The rules the project states about its own layout, checked on the source (``make check`` too).

* Leaves (errors, config, keys, codec and their private helpers) import nothing else from s3kv.
* Dependencies point inward: storage and the manifest never import the store, the connector,
  the CLI or ops; the store never imports the connector, the CLI or ops; ops never import the
  CLI or the connector; the connector never imports the CLI or ops.
* Users of a subpackage import its front (``s3kv.storage``, ``s3kv.manifest``), not its parts.
* One boto3/botocore importer per AWS service (``s3kv/storage/s3.py``, and
  ``s3kv/storage/kms.py`` for KMS-held block keys); one awscrt importer
  (``s3kv/storage/crt.py``, object GET/PUT); one tensorrt_llm importer
  (``s3kv/connector/api.py``).
* The product never imports its test harness (``s3kv.testing``: the emulator, the local S3
  server, the SmolLM2 loader, the backend contract suite), with one exception: the
  ``s3kv local-s3`` command (``s3kv/cli/cmd_admin.py``) imports ``s3kv.testing.local_s3``,
  inside the command, so that the one local-S3 CLI is the operator CLI's.

Every ``import`` statement counts, also those inside functions.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "s3kv"

LEAVES = {"s3kv.errors", "s3kv.config", "s3kv.keys", "s3kv.codec", "s3kv._planes", "s3kv._zstd"}
HARNESS = ("s3kv.testing",)
#: (importer, harness module) pairs allowed despite HARNESS: the `s3kv local-s3` command.
HARNESS_EXCEPTIONS = {("s3kv.cli.cmd_admin", "s3kv.testing.local_s3")}
FRONTS = ("s3kv.storage", "s3kv.manifest")

#: importer prefix -> prefixes it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "s3kv.storage": ("s3kv.store", "s3kv.connector", "s3kv.cli", "s3kv.ops", "s3kv.manifest"),
    "s3kv.manifest": ("s3kv.store", "s3kv.connector", "s3kv.cli", "s3kv.ops"),
    "s3kv.store": ("s3kv.connector", "s3kv.cli", "s3kv.ops"),
    "s3kv.ops": ("s3kv.cli", "s3kv.connector"),
    "s3kv.connector": ("s3kv.cli", "s3kv.ops"),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports (absolute names; relative imports resolved)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            yield base
            # NOTE: `from s3kv import storage` imports the subpackage s3kv.storage.
            yield from (f"{base}.{alias.name}" for alias in node.names if base == "s3kv")


def sources() -> list[tuple[str, Path]]:
    return sorted((module_name(p), p) for p in PACKAGE.rglob("*.py"))


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def product_modules() -> list[tuple[str, Path]]:
    return [(m, p) for m, p in sources() if not any(within(m, h) for h in HARNESS)]


def test_leaves_import_only_leaves() -> None:
    bad = [
        f"{module} imports {name}"
        for module, path in sources()
        if module in LEAVES
        for name in imports(path)
        if within(name, "s3kv") and name not in LEAVES and name != "s3kv"
    ]
    assert not bad


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_dependencies_point_inward(importer: str) -> None:
    bad = [
        f"{module} imports {name}"
        for module, path in sources()
        if within(module, importer)
        for name in imports(path)
        if any(within(name, f) for f in FORBIDDEN[importer])
    ]
    assert not bad


@pytest.mark.parametrize("front", FRONTS)
def test_users_import_the_front_not_the_parts(front: str) -> None:
    if not (PACKAGE / front.split(".")[1]).is_dir():
        pytest.skip(f"{front} is not a subpackage yet")
    bad = [
        f"{module} imports {name}"
        for module, path in sources()
        if not within(module, front)
        for name in imports(path)
        if name.startswith(front + ".")
    ]
    assert not bad


@pytest.mark.parametrize(
    ("library", "allowed"),
    [("boto3", ["s3kv.storage.kms", "s3kv.storage.s3"]),
     ("botocore", ["s3kv.storage.kms", "s3kv.storage.s3"]),
     ("awscrt", ["s3kv.storage.crt"]),
     ("tensorrt_llm", ["s3kv.connector.api"])],
)  # fmt: skip
def test_one_importer_per_foreign_engine(library: str, allowed: list[str]) -> None:
    importers = sorted(
        {module for module, path in sources() for name in imports(path) if within(name, library)}
    )
    assert importers in (allowed, []), f"{library} imported by {importers}"


def test_the_product_never_imports_its_harness() -> None:
    bad = [
        f"{module} imports {name}"
        for module, path in product_modules()
        for name in imports(path)
        if any(within(name, h) for h in HARNESS) and (module, name) not in HARNESS_EXCEPTIONS
    ]
    assert not bad
