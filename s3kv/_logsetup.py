"""Logging s3kv sets up: the ``log_level`` setting and credential redaction (a leaf).

``log_level``: only the ``s3kv`` logger is touched, never the root logger: the application's
own logging setup stays in charge of everything else. When nothing would print the chosen
level (no handler on ``s3kv`` or any ancestor: Python's last-resort handler shows WARNING and
above only), one stderr handler is added to ``s3kv`` so that ``debug``/``info`` reach the log.

Redaction: at DEBUG, botocore logs every prepared request with its headers (the session
token in ``X-Amz-Security-Token``, the ``Authorization`` credential scope and signature),
and the response bodies of STS, container-credential and KMS calls (secret keys, tokens,
KMS plaintext data keys); urllib3 logs request lines (presigned query strings).
:func:`install_redaction` puts :class:`RedactingFilter` on the loggers of those packages,
which rewrites each record's message with the values replaced by ``<redacted>``. It is
installed by s3kv when it opens an AWS client; the application's handlers and levels are
left alone. Imports nothing of s3kv.
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = [
    "LOGGER_NAME",
    "REDACTED",
    "REDACTED_LOGGERS",
    "RedactingFilter",
    "apply_log_level",
    "install_redaction",
    "redact",
]

#: The logger every s3kv module logs below.
LOGGER_NAME = "s3kv"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_lock = threading.Lock()


class _S3KVHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The stderr handler :func:`apply_log_level` adds (recognised so it is added once)."""


def apply_log_level(level: str) -> None:
    """Set the ``s3kv`` logger to ``level`` (a lower-case ``logging`` level name).

    ``""`` leaves the logger alone (its level and handlers are the application's).

    Raises:
        ValueError: ``level`` is not a ``logging`` level name.
    """
    if not level:
        return
    number = logging.getLevelName(level.upper())
    if not isinstance(number, int):
        raise ValueError(f"log_level: unknown level {level!r}")
    logger = logging.getLogger(LOGGER_NAME)
    with _lock:
        logger.setLevel(number)
        if not logger.hasHandlers():
            handler = _S3KVHandler()
            handler.setFormatter(logging.Formatter(_FORMAT))
            logger.addHandler(handler)


#: Packages whose loggers s3kv drives through boto3 (their DEBUG output carries secrets).
REDACTED_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer", "awscrt")
#: What a secret value is replaced with.
REDACTED = "<redacted>"

# NOTE: headers, query parameters and config keys whose values are secrets or signatures.
_NAMES = (
    r"x-amz-security-token|x-amz-signature|x-amz-credential|authorization|"
    r"x-amz-(?:copy-source-)?server-side-encryption-customer-key(?:-md5)?|"
    r"aws_secret_access_key|aws_session_token|aws_security_token"
)
# NOTE: JSON / XML fields of credential and KMS replies (STS, ECS/EKS, IMDS, KMS).
_FIELDS = r"SecretAccessKey|SessionToken|Token|Plaintext|secret_access_key|session_token"
_PATTERNS = (
    # 'X-Amz-Security-Token': b'...'  /  "SecretAccessKey": "..."  (a quoted value)
    re.compile(rf"""((?i:{_NAMES})['"]?\s*[:=]\s*b?(['"]))(.*?)(\2)"""),
    re.compile(rf"""("(?:{_FIELDS})"\s*:\s*")([^"]*)(")"""),
    # x-amz-security-token:VALUE (canonical request), X-Amz-Signature=VALUE (query string)
    re.compile(rf"""((?i:{_NAMES})\s*[:=]\s*)([^\s'"&,;<>]+)()"""),
    # <SecretAccessKey>VALUE</SecretAccessKey>
    re.compile(rf"(<(?:{_FIELDS})>)([^<]*)(</)"),
    # the parts of an Authorization value and botocore's "Signature:\n<hex>" line
    re.compile(r"(\b(?:Credential|Signature)\s*[=:]\s*)([^\s,'\"&;<>]+)()"),
)


def redact(text: str) -> str:
    """``text`` with every credential, token and signature value replaced by ``<redacted>``."""
    for pattern in _PATTERNS:
        text = pattern.sub(_replace, text)
    return text


def _replace(match: re.Match[str]) -> str:
    groups = match.groups()
    if len(groups) == 4:  # the quoted-value pattern: keep the name and both quotes
        return f"{groups[0]}{REDACTED}{groups[3]}"
    return f"{groups[0]}{REDACTED}{groups[2]}"


class RedactingFilter(logging.Filter):
    """Rewrites a record's message with :func:`redact`; never drops a record.

    The message is formatted first (botocore passes headers as dict and object arguments),
    then stored back as ``msg`` with ``args`` cleared, so no handler formats the original.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # NOTE: a malformed record: logging reports it at emit time
            return True
        scrubbed = redact(message)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        return True


_FILTER = RedactingFilter()


def install_redaction() -> None:
    """Put the one :class:`RedactingFilter` on every logger of :data:`REDACTED_LOGGERS`.

    Idempotent and cheap (a walk over the logger names): call it whenever an AWS client is
    made. NOTE: a logger's filters see only the records logged on that very logger, not its
    children's, so each existing child logger (``botocore.endpoint``, ``urllib3.connectionpool``)
    gets the filter too; a child created later (a module imported later) gets it on the
    next call, and the modules that log requests are imported with the client.
    """
    manager = logging.Logger.manager
    with _lock:
        names = {
            name for name in list(manager.loggerDict) if name.split(".")[0] in REDACTED_LOGGERS
        }
        for name in sorted(names | set(REDACTED_LOGGERS)):
            logger = logging.getLogger(name)
            if not any(isinstance(f, RedactingFilter) for f in logger.filters):
                logger.addFilter(_FILTER)
