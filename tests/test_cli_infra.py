"""The files under ``infra/`` that cannot run here (AWS, Kubernetes, Docker), validated.

What is checked: every YAML and JSON file parses; the IAM policies pass moto's IAM policy
validator and grant exactly what ``infra/aws/README.md`` says on the real key layout
(:mod:`s3kv.keys`); the lifecycle rule passes botocore's schema and moto; the CronJob's
command is accepted by the real CLI and its settings are real s3kv settings.
"""

from __future__ import annotations

import fnmatch
import json
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from cli_support import DAY, Bucket, Clock, invoke, parse_json

from s3kv.cli.context import Runtime
from s3kv.config import S3KVConfig
from s3kv.keys import block_object_key, identity_object_key, manifest_prefix
from s3kv.storage import S3Backend

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
FP = "0123456789abcdef0123456789abcdef"
BLOCK = block_object_key("s3kv", FP, bytes(range(16)))  # type: ignore[arg-type]
SEGMENT = manifest_prefix("s3kv", FP) + "segments/1700000000000-a-000000.seg"
CURRENT = manifest_prefix("s3kv", FP) + "CURRENT"
IDENTITY = identity_object_key("s3kv", FP)
PROBE = "s3kv/.s3kv-probe/doctor-123"


def load_json(name: str) -> Any:
    return json.loads((INFRA / "aws" / name).read_text())


def allows(policy: dict[str, Any], action: str, key: str | None) -> bool:
    """Whether an Allow statement matches (conditions ignored: they only narrow listing)."""
    arn = "arn:aws:s3:::BUCKET" + ("" if key is None else f"/{key}")
    for statement in policy["Statement"]:
        actions = statement["Action"]
        resources = statement["Resource"]
        actions = [actions] if isinstance(actions, str) else actions
        resources = [resources] if isinstance(resources, str) else resources
        if statement["Effect"] == "Allow" and action in actions and any(
            fnmatch.fnmatchcase(arn, pattern) for pattern in resources
        ):  # fmt: skip
            return True
    return False


@pytest.mark.parametrize(
    "name", ["engine-policy.json", "engine-policy-tenant.json", "pruner-policy.json"]
)
def test_policies_pass_the_iam_validator(name: str, aws_env: None) -> None:
    from moto import mock_aws

    with mock_aws():
        iam = boto3.client("iam", region_name="us-east-1")
        iam.create_policy(PolicyName="s3kv", PolicyDocument=(INFRA / "aws" / name).read_text())


def test_engine_policy_reads_and_writes_but_deletes_only_manifest_objects() -> None:
    engine = load_json("engine-policy.json")
    assert allows(engine, "s3:ListBucket", None)
    for key in (BLOCK, SEGMENT, CURRENT, IDENTITY):
        assert allows(engine, "s3:GetObject", key)
        assert allows(engine, "s3:PutObject", key)
    assert not allows(engine, "s3:DeleteObject", BLOCK)  # never block data
    assert not allows(engine, "s3:DeleteObject", IDENTITY)
    assert allows(engine, "s3:DeleteObject", SEGMENT)  # the elected compactor's folding
    assert allows(engine, "s3:DeleteObject", PROBE)  # the conditional-PUT probe's cleanup
    assert not allows(engine, "s3:GetObject", "other-team/secret")


def test_tenant_engine_policy_confines_each_tenant_to_its_own_prefix() -> None:
    # Engines of tenant-a run with TLLM_S3KV_PREFIX=s3kv/tenant-a under a role tagged
    # s3kv-tenant=tenant-a; IAM substitutes the tag into the policy variable.
    text = (INFRA / "aws" / "engine-policy-tenant.json").read_text()
    policy = json.loads(text.replace("${aws:PrincipalTag/s3kv-tenant}", "tenant-a"))
    mine = "s3kv/tenant-a"
    for key in (
        block_object_key(mine, FP, bytes(range(16))),  # type: ignore[arg-type]
        manifest_prefix(mine, FP) + "segments/1700000000000-a-000000.seg",
        identity_object_key(mine, FP),
    ):
        assert allows(policy, "s3:GetObject", key)
        assert allows(policy, "s3:PutObject", key)
    assert allows(policy, "s3:DeleteObject", manifest_prefix(mine, FP) + "deltas/x")
    assert not allows(policy, "s3:DeleteObject", block_object_key(mine, FP, bytes(16)))  # type: ignore[arg-type]
    theirs = block_object_key("s3kv/tenant-b", FP, bytes(range(16)))  # type: ignore[arg-type]
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
        assert not allows(policy, action, theirs)
    assert not allows(policy, "s3:PutObject", BLOCK)  # nor the shared, untenanted prefix


def test_pruner_policy_deletes_and_rewrites_the_manifest_but_cannot_touch_block_bytes() -> None:
    pruner = load_json("pruner-policy.json")
    assert allows(pruner, "s3:ListBucket", None)
    for key in (BLOCK, SEGMENT):
        assert allows(pruner, "s3:DeleteObject", key)
    for key in (SEGMENT, CURRENT, IDENTITY, PROBE):
        assert allows(pruner, "s3:GetObject", key)
    for key in (CURRENT, SEGMENT, PROBE):
        assert allows(pruner, "s3:PutObject", key)
    assert not allows(pruner, "s3:GetObject", BLOCK)
    assert not allows(pruner, "s3:PutObject", BLOCK)
    assert not allows(pruner, "s3:DeleteObject", "other-team/data")


def test_lifecycle_rule_is_valid_and_a_backstop(moto_backend: S3Backend) -> None:
    import botocore.session
    import botocore.validate

    rules = load_json("lifecycle.json")
    shape = (
        botocore.session.get_session()
        .get_service_model("s3")
        .operation_model("PutBucketLifecycleConfiguration")
        .input_shape
    )
    botocore.validate.validate_parameters(
        {"Bucket": "b", "LifecycleConfiguration": rules}, shape
    )  # raises on a schema error
    moto_backend.client.put_bucket_lifecycle_configuration(
        Bucket=moto_backend.bucket,
        LifecycleConfiguration=rules,
    )
    (rule,) = rules["Rules"]
    assert rule["Filter"]["Prefix"] == "s3kv/"
    assert rule["Expiration"]["Days"] > 7 * 4  # well beyond prune's window


def test_yaml_files_parse_and_compose_binds_loopback() -> None:
    compose = yaml.safe_load((INFRA / "minio" / "docker-compose.yml").read_text())
    ports = compose["services"]["minio"]["ports"]
    assert all(str(p).startswith("127.0.0.1:") for p in ports)
    kinds = [d["kind"] for d in yaml.safe_load_all((INFRA / "k8s" / "prune-cronjob.yaml").open())]
    assert kinds == ["ServiceAccount", "ConfigMap", "Secret", "CronJob"]


def cronjob() -> tuple[list[str], dict[str, str]]:
    """The CronJob's argv and its ConfigMap's settings."""
    docs = {d["kind"]: d for d in yaml.safe_load_all((INFRA / "k8s" / "prune-cronjob.yaml").open())}
    job = docs["CronJob"]
    assert job["apiVersion"] == "batch/v1"
    pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
    (container,) = pod["containers"]
    refs = [e.get("configMapRef", e.get("secretRef"))["name"] for e in container["envFrom"]]
    assert refs == [docs["ConfigMap"]["metadata"]["name"], docs["Secret"]["metadata"]["name"]]
    return [*container["command"], *container["args"]], dict(docs["ConfigMap"]["data"])


def test_cronjob_runs_the_real_cli(moto_backend: S3Backend) -> None:
    argv, settings = cronjob()
    assert argv == ["s3kv", "prune", "--older-than", "7d", "--yes"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["s3kv"] == "s3kv.cli:main"

    # Its flags parse, and its settings are s3kv settings (unknown TLLM_S3KV_* names fail).
    assert invoke([*argv[1:], "--help"]).exit_code == 0
    S3KVConfig.load(environ=settings)

    # Pointed at a real bucket through the same variables, it runs (as a dry run).
    b = Bucket(moto_backend, str(moto_backend.client.meta.endpoint_url), moto_backend.bucket)
    b.prefix = settings["TLLM_S3KV_PREFIX"]
    b.write_identity()
    b.write_chain(b.chain(range(8)), Clock(time.time()))
    env = {**settings, "TLLM_S3KV_BUCKET": b.bucket, "TLLM_S3KV_ENDPOINT_URL": b.endpoint}
    month_later = Runtime(environ=env, clock=Clock(time.time() + 30 * DAY))
    result = invoke([*argv[1:], "--dry-run", "--json"], runtime=month_later)
    assert result.exit_code == 0, result.output
    assert parse_json(result)["planned"]["objects"] == 2
