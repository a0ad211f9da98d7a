"""The ``s3kv`` operator CLI: ``s3kv prune|stats|verify|compact|pin|unpin|pins|doctor|local-s3``.

The console script ``s3kv`` calls :func:`main`. The commands live in :mod:`s3kv.cli.app`
(thin: parse, call :mod:`s3kv.ops`, print); importing this package imports neither torch
nor transformers (a tokenizer is loaded only by ``pin --text``).
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``) and exit with its status."""
    from s3kv.cli.app import run

    run(argv)


__all__ = ["main"]
