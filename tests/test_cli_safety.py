"""The CLI's safety: what keeps an operator's typo or a wrong identity from a silent loss.

Each test is one item of the issue: a bare number as a duration, the share of a fingerprint
a run deletes, an empty scope, a refused delete, read-only commands that never write, verify's
deletions, ``--json`` failures, Ctrl-C at a prompt, the connection flags, ``--help``; and the
README's store example, which must record the hits that keep its blocks through prune.

Buckets are ``file://`` directories (fast, no server); time is injected with ``Runtime``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import typer
from cli_support import (
    ADMIN,
    DAY,
    READ_ONLY,
    Bucket,
    Clock,
    assert_one_error_line,
    invoke,
    parse_json,
)
from typer.testing import CliRunner

from s3kv.cli import safety
from s3kv.cli.app import app
from s3kv.cli.context import CommandError, Runtime
from s3kv.config import S3KVConfig
from s3kv.errors import AccessDeniedError, StorageError
from s3kv.keys import BlockHash
from s3kv.manifest import load_usage
from s3kv.storage import (
    Backend,
    DelegatingBackend,
    DeleteResult,
    FileBackend,
    S3Backend,
    make_client,
    open_backend,
)
from s3kv.testing.local_s3 import LocalS3

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Bucket:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")  # small snapshots: fast tests
    for name in ("TLLM_S3KV_BUCKET", "TLLM_S3KV_CONDITIONAL_PUT", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    root = tmp_path / "bucket"
    root.mkdir()
    b = Bucket(FileBackend(root), f"file://{root}", bucket="")
    b.write_identity()
    return b


def last_line(result: Any) -> str:
    """The last line on stderr (after a prompt's lines): the one ``Error:`` line."""
    # NOTE: an answer from a pipe is not echoed: the error follows the prompt on its line.
    lines = [line.split("[y/N]: ")[-1] for line in result.stderr.splitlines()]
    errors = [line for line in lines if line.startswith("Error: ")]
    assert len(errors) == 1, result.stderr
    assert errors[0] == lines[-1] or not "".join(lines[lines.index(errors[0]) + 1 :]).strip()
    return str(errors[0])


def args(bucket: Bucket, *extra: str) -> list[str]:
    """Connection flags for a ``file://`` bucket (no ``--bucket`` needed)."""
    return [*extra, "--prefix", bucket.prefix, "--endpoint-url", bucket.endpoint]


class Stale:
    """Two blocks used three days ago, three never used again: a week's prune deletes 60%."""

    def __init__(self, bucket: Bucket) -> None:
        self.bucket = bucket
        self.t0 = time.time()
        self.used = bucket.chain(range(8))
        self.stale = bucket.chain(range(100, 112))
        bucket.write_chain(self.used, Clock(self.t0 - 20 * DAY))
        bucket.write_chain(self.stale, Clock(self.t0 - 20 * DAY), seed=10)
        bucket.record(Clock(self.t0 + 5 * DAY), hits=[self.used[-1]])
        self.before = bucket.block_keys()

    @property
    def doomed(self) -> set[str]:
        return {self.bucket.object_key(k) for k in self.stale}

    def runtime(self, **kw: Any) -> Runtime:
        return Runtime(clock=Clock(self.t0 + 8 * DAY), **kw)

    def prune(self, *extra: str) -> list[str]:
        return ["prune", *args(self.bucket, "--older-than", "7d", *extra)]


# --- durations ----------------------------------------------------------------------------


def test_a_bare_number_is_not_seconds(bucket: Bucket) -> None:
    s = Stale(bucket)
    for command in (s.prune("--dry-run"), s.prune()):
        command[command.index("7d")] = "7"
        refused = invoke(command, runtime=s.runtime())
        assert_one_error_line(refused, "--older-than", "7d", "unit", code=2)
    assert bucket.block_keys() == s.before


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("7d", 7 * DAY), ("2w", 14 * DAY), ("7d12h", 7.5 * DAY), ("1h30m", 5400),
     ("1.5h", 5400), (" 12h ", 12 * 3600)],
)  # fmt: skip
def test_durations_take_units_and_compounds(text: str, seconds: float) -> None:
    assert safety.parse_window(text, flag="--older-than") == seconds


@pytest.mark.parametrize("text", ["7", "0", "7x", "7D", "d", "7d7d", "0s", "0d0h", "-1d", ""])
def test_bad_durations_name_the_flag(text: str) -> None:
    with pytest.raises(CommandError, match=r"^--older-than: ") as caught:
        safety.parse_window(text, flag="--older-than")
    assert caught.value.exit_code == 2


def test_a_compound_window_reaches_the_plan(bucket: Bucket) -> None:
    s = Stale(bucket)
    command = s.prune("--dry-run", "--json")
    command[command.index("7d")] = "7d12h"
    dry = invoke(command, runtime=s.runtime())
    assert dry.exit_code == 0, dry.output
    assert parse_json(dry)["older_than_s"] == 7.5 * DAY


# --- the share of a fingerprint a run deletes ---------------------------------------------


def test_a_large_share_is_confirmed_whatever_the_count(bucket: Bucket) -> None:
    s = Stale(bucket)  # 3 of 5 blocks: far below --confirm-above 1000, above half

    refused = invoke(s.prune(), runtime=s.runtime())
    assert_one_error_line(refused, "60%", bucket.fingerprint, "--confirm-share", "--yes", code=1)
    assert bucket.block_keys() == s.before

    no = invoke(s.prune(), runtime=s.runtime(interactive=True), input="n\n")
    assert no.exit_code == 1
    assert last_line(no) == "Error: aborted: nothing was deleted"
    assert bucket.block_keys() == s.before

    yes = invoke(s.prune(), runtime=s.runtime(interactive=True), input="y\n")
    assert yes.exit_code == 0, yes.output
    assert "60%" in yes.stderr  # the question said why it asked
    assert bucket.block_keys() == s.before - s.doomed


@pytest.mark.parametrize("extra", [["--yes"], ["--confirm-share", "0.7"]])
def test_yes_or_a_higher_share_goes_ahead(bucket: Bucket, extra: list[str]) -> None:
    s = Stale(bucket)
    run = invoke(s.prune(*extra, "--json"), runtime=s.runtime())
    assert run.exit_code == 0, run.output
    assert parse_json(run)["deleted"]["objects"] == 3


# --- nothing in scope ---------------------------------------------------------------------

SCOPED = [
    ["prune", "--older-than", "7d", "--dry-run"],
    ["prune", "--older-than", "7d", "--yes"],
    ["stats"],
    ["verify"],
    ["compact"],
    ["pins"],
    ["pin", "00" * 16],
    ["unpin", "00" * 16],
]


@pytest.mark.parametrize("command", SCOPED, ids=lambda c: " ".join(c[:2]))
def test_nothing_in_scope_is_an_error(bucket: Bucket, command: list[str]) -> None:
    wrong_prefix = [*command, "--prefix", "kv-typo", "--endpoint-url", bucket.endpoint]
    line = assert_one_error_line(invoke(wrong_prefix), "nothing in scope", "kv-typo", code=2)
    assert "--prefix" in line

    model = invoke([*command, *args(bucket), "--model", "nobody/*"])
    assert_one_error_line(model, "--model", "nobody/*", code=2)


def test_an_empty_bucket_is_nothing_in_scope(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = invoke(["stats", "--endpoint-url", f"file://{tmp_path / 'empty'}", "--json"])
    assert_one_error_line(result, "nothing in scope", code=2)
    assert parse_json(result)["error"].startswith("nothing in scope")


# --- refused deletes ----------------------------------------------------------------------


class DenyDeletes(DelegatingBackend):
    """Refuses every delete: per key (as AWS answers DeleteObjects), or the whole request."""

    def __init__(self, inner: Backend, *, whole: bool) -> None:
        super().__init__(inner)
        self.whole = whole

    def delete_many(self, keys: Iterable[str]) -> DeleteResult:
        if self.whole:
            raise AccessDeniedError("access denied on delete_many s3://b [AccessDenied, HTTP 403]")
        return DeleteResult(failed=dict.fromkeys(keys, "AccessDenied: Access Denied"))


def _denying(whole: bool) -> Callable[[S3KVConfig], Backend]:
    return lambda cfg: DenyDeletes(open_backend(cfg), whole=whole)


@pytest.mark.parametrize("whole", [False, True], ids=["per-key", "whole-request"])
def test_a_refused_delete_is_a_permission(bucket: Bucket, whole: bool) -> None:
    s = Stale(bucket)
    denied = invoke(s.prune("--yes"), runtime=s.runtime(open_backend=_denying(whole)))
    line = assert_one_error_line(denied, "permission", "s3:DeleteObject", code=1)
    assert "re-run" not in line
    assert bucket.block_keys() == s.before

    # With --json: the report, and only the report (it says what failed).
    as_json = invoke(s.prune("--yes", "--json"), runtime=s.runtime(open_backend=_denying(whole)))
    assert parse_json(as_json)["complete"] is False


def _corrupt(bucket: Bucket, keys: list[BlockHash]) -> None:
    for key in keys:
        object_key = bucket.object_key(key)
        blob = bytearray(bucket.backend.get(object_key) or b"")
        blob[-1] ^= 0xFF
        bucket.backend.put(object_key, bytes(blob))


@pytest.mark.parametrize("whole", [False, True], ids=["per-key", "whole-request"])
def test_verify_says_permission_too(bucket: Bucket, whole: bool) -> None:
    chain = bucket.chain(range(20))
    bucket.write_chain(chain, Clock(time.time()))
    _corrupt(bucket, chain[1:2])
    run = invoke(["verify", "--all", "--delete-corrupt", *args(bucket)],
                 runtime=Runtime(open_backend=_denying(whole)))  # fmt: skip
    line = assert_one_error_line(run, "permission", "s3:DeleteObject", code=1)
    assert "re-run" not in line
    assert bucket.object_key(chain[1]) in bucket.block_keys()


# --- read-only commands never probe conditional writes ------------------------------------


@pytest.mark.parametrize(
    ("command", "writes"),
    [
        (["stats"], False),
        (["pins"], False),
        (["verify"], False),
        (["verify", "--delete-corrupt", "--dry-run"], False),
        (["prune", "--older-than", "7d", "--dry-run"], False),
        (["prune", "--older-than", "7d", "--yes"], True),
        (["compact"], True),
    ],
)
def test_only_writing_commands_probe_conditional_put(
    bucket: Bucket, command: list[str], writes: bool
) -> None:
    seen: list[str] = []

    def opener(cfg: S3KVConfig) -> Backend:
        seen.append(cfg.conditional_put)
        return open_backend(cfg)

    env = {"TLLM_S3KV_CONDITIONAL_PUT": "auto", "TLLM_S3KV_BLOOM_CAPACITY": "10000"}
    result = invoke([*command, *args(bucket)], runtime=Runtime(open_backend=opener, environ=env))
    assert result.exit_code == 0, result.output
    assert seen == ["auto" if writes else "off"]


# --- verify --delete-corrupt --------------------------------------------------------------


def _planted(bucket: Bucket) -> tuple[list[BlockHash], str]:
    """Five blocks, three of them corrupt, and a key that is not an s3kv block key."""
    chain = bucket.chain(range(20))
    bucket.write_chain(chain, Clock(time.time()))
    _corrupt(bucket, chain[1:4])
    junk = f"{bucket.prefix}/{bucket.fingerprint}/blocks/zz/notes.txt"
    bucket.backend.put(junk, b"someone else's file")
    return chain, junk


def test_verify_dry_run_deletes_nothing(bucket: Bucket) -> None:
    _planted(bucket)
    before = bucket.block_keys()
    dry = invoke(["verify", "--all", "--delete-corrupt", "--dry-run", "--json", *args(bucket)])
    assert_one_error_line(dry, "dry run", code=1)
    doc = parse_json(dry)
    assert (doc["dry_run"], doc["deletable"], doc["deleted"]) == (True, 3, 0)
    assert bucket.block_keys() == before
    human = invoke(["verify", "--all", "--delete-corrupt", "--dry-run", *args(bucket)])
    assert "would delete 3 objects" in human.stdout


def test_verify_fails_when_the_manifest_is_not_rewritten(
    bucket: Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = bucket.chain(range(20))
    bucket.write_chain(chain, Clock(time.time()))
    _corrupt(bucket, chain[1:2])

    def refused(*_args: Any, **_kwargs: Any) -> Any:
        raise StorageError("injected: the manifest rewrite failed")

    monkeypatch.setattr("s3kv.ops.verify.compact", refused)
    run = invoke(["verify", "--all", "--delete-corrupt", "--yes", *args(bucket)])
    assert_one_error_line(run, "manifest not rewritten", "s3kv compact", code=1)
    assert bucket.object_key(chain[1]) not in bucket.block_keys()


def test_verify_confirms_like_prune_and_deletes_only_s3kv_keys(bucket: Bucket) -> None:
    chain, junk = _planted(bucket)
    before = bucket.block_keys()
    corrupt = {bucket.object_key(k) for k in chain[1:4]}

    # 3 of 5 blocks: more than half, so no terminal means no deletion.
    refused = invoke(["verify", "--all", "--delete-corrupt", *args(bucket)])
    assert_one_error_line(refused, "--confirm-share", "--yes", code=1)
    assert bucket.block_keys() == before
    at_terminal = invoke(["verify", "--all", "--delete-corrupt", *args(bucket)],
                         runtime=Runtime(interactive=True), input="n\n")  # fmt: skip
    assert at_terminal.exit_code == 1
    assert last_line(at_terminal) == "Error: aborted: nothing was deleted"
    assert bucket.block_keys() == before

    done = invoke(["verify", "--all", "--delete-corrupt", "--yes", "--json", *args(bucket)])
    line = assert_one_error_line(done, "1 objects under blocks/ are not s3kv block keys", code=1)
    assert "remain" not in line  # the junk stays, and is named; the corrupt ones are gone
    assert {f["key"] for f in parse_json(done)["findings"] if f["deleted"]} == corrupt
    assert bucket.block_keys() == before - corrupt
    assert junk in bucket.block_keys()


# --- --json failures, Ctrl-C, connection flags --------------------------------------------


@pytest.mark.parametrize(
    ("command", "name", "code"),
    [
        (["prune", "--older-than", "7", "--json"], "prune", 2),
        (["prune", "--older-than", "7d", "--bogus", "--json"], "prune", 2),
        (["stats", "--json", "--endpoint-url", "file:///no/such/dir"], "stats", 1),
        (["local-s3", "stop", "--grace", "x", "--json"], "local-s3 stop", 2),
    ],
)
def test_json_failures_print_an_error_document(command: list[str], name: str, code: int) -> None:
    result = invoke(command)
    line = assert_one_error_line(result, code=code)
    doc = parse_json(result)
    assert doc == {"error": line.removeprefix("Error: "), "command": name, "exit_code": code}


def test_ctrl_c_at_the_prompt_exits_130(bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> None:
    s = Stale(bucket)

    def interrupt() -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(safety, "_readline", interrupt)
    result = invoke(s.prune("--json"), runtime=s.runtime(interactive=True))
    assert result.exit_code == 130, result.output
    assert last_line(result) == "Error: interrupted at the prompt: nothing was deleted"
    assert "Traceback" not in result.output
    assert parse_json(result)["exit_code"] == 130
    assert bucket.block_keys() == s.before


def test_region_and_ca_bundle_flags(bucket: Bucket, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    seen: list[S3KVConfig] = []

    def opener(cfg: S3KVConfig) -> Backend:
        seen.append(cfg)
        return open_backend(cfg)

    flags = ["--region", "eu-west-3", "--ca-bundle", str(ca)]
    result = invoke(["stats", *args(bucket, *flags)], runtime=Runtime(open_backend=opener))
    assert result.exit_code == 0, result.output
    assert (seen[0].region, seen[0].ca_bundle) == ("eu-west-3", str(ca))

    doctor = invoke(["doctor", "--json", *args(bucket, *flags)])
    settings = {s["name"]: s for s in parse_json(doctor)["settings"]}
    assert settings["region"]["value"] == "eu-west-3"
    assert settings["region"]["source"] == "command line"

    missing = invoke(["stats", *args(bucket, "--ca-bundle", str(tmp_path / "none.pem"))])
    assert_one_error_line(missing, "--ca-bundle", "none.pem", code=2)


# --- --help -------------------------------------------------------------------------------


def _paths(command: Any, path: tuple[str, ...] = ()) -> Iterable[tuple[str, ...]]:
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from _paths(sub, (*path, name))


TYPE_LABEL = re.compile(r"<(bool|str|int|float|path|list\[|[a-z]+ range)")


def test_help_shows_examples_and_plain_types() -> None:
    root = typer.main.get_command(app)
    paths = list(_paths(root))
    assert ("local-s3", "start") in paths
    runner = CliRunner()
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert not TYPE_LABEL.search(result.stdout), (path, TYPE_LABEL.findall(result.stdout))
        assert "Examples" in result.stdout, path


def test_local_s3_alone_shows_help() -> None:
    result = invoke(["local-s3"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout
    assert "start" in result.stdout
    assert "Error" not in result.output


# --- the README's store example -----------------------------------------------------------


def _store_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using the store directly", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README: no python block under 'Using the store directly'"
    return match.group(1)


def test_the_store_example_records_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the README's example twice: the second run reuses the blocks the first saved, and
    records them as hits (what keeps them through prune)."""
    root = tmp_path / "bucket"
    root.mkdir()
    monkeypatch.setenv("TLLM_S3KV_ENDPOINT_URL", f"file://{root}")
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")
    monkeypatch.delenv("TLLM_S3KV_CONFIG", raising=False)
    code = compile(_store_example(), "README.md", "exec")
    block_shape = (32, 2, 32, 8, 128)  # layers, kv, tokens, heads, head_dim: the identity's
    nbytes = int(np.prod(block_shape)) * 2
    loaded: list[bytes] = []

    def run() -> dict[str, Any]:
        namespace: dict[str, Any] = {
            "prompt_token_ids": list(range(64)),  # two blocks of 32 tokens
            "block_shape": block_shape,
            "block_bytes": lambda key: bytes(key) * (nbytes // len(key)),
            "load_into_kv_cache": lambda key, data: loaded.append(bytes(data[:16])),
        }
        exec(code, namespace)
        return namespace

    first = run()
    assert loaded == []  # an empty bucket: nothing to reuse, both blocks saved
    second = run()
    keys = second["keys"]
    assert second["reused"] == 2
    assert loaded == [bytes(k) for k in keys]
    identity = first["identity"]
    usage = load_usage(FileBackend(root), "s3kv", identity.fingerprint())
    assert [(row.hits if (row := usage.row(k)) else None) for k in keys] == [1, 1]


def test_json_error_document_is_one_document(bucket: Bucket) -> None:
    """A failure after the command's own document adds no second one (it is parseable)."""
    s = Stale(bucket)
    denied = invoke(s.prune("--yes", "--json"), runtime=s.runtime(open_backend=_denying(False)))
    assert denied.exit_code == 1
    doc = json.loads(denied.stdout)
    assert doc["command"] == "prune"
    assert "error" not in doc


# --- a refused delete from a real server ---------------------------------------------------


@pytest.mark.seaweedfs
def test_a_read_only_identity_is_told_permission(
    read_only_seaweedfs: LocalS3, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TLLM_S3KV_BLOOM_CAPACITY", "10000")
    cfg = S3KVConfig(bucket=read_only_seaweedfs.bucket, endpoint_url=read_only_seaweedfs.endpoint,
                     region="us-east-1", conditional_put="off")  # fmt: skip
    admin = S3Backend.from_config(cfg, client=make_client(cfg, access_key=ADMIN[0],
                                                          secret_key=ADMIN[1]))  # fmt: skip
    bucket = Bucket(admin, read_only_seaweedfs.endpoint, read_only_seaweedfs.bucket)
    bucket.write_identity()
    s = Stale(bucket)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", READ_ONLY[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", READ_ONLY[1])
    connection = ["--bucket", bucket.bucket, "--prefix", bucket.prefix,
                  "--endpoint-url", bucket.endpoint]  # fmt: skip

    # Reading works with these credentials, and a dry run neither probes nor warns.
    dry = invoke(["prune", "--older-than", "7d", "--dry-run", "--json", *connection],
                 runtime=s.runtime())  # fmt: skip
    assert dry.exit_code == 0, dry.output
    assert parse_json(dry)["planned"]["objects"] == 3
    assert dry.stderr == ""

    refused = invoke(["prune", "--older-than", "7d", "--yes", *connection], runtime=s.runtime())
    line = assert_one_error_line(refused, "permission", "s3:DeleteObject", code=1)
    assert "re-run" not in line
    assert bucket.block_keys() == s.before
    admin.close()
