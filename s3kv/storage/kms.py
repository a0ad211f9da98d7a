"""AWS KMS for ``auth_keys = kms:PATH``: data keys decrypted once at startup, made on demand.

The second module that imports boto3 (S3 is the first, :mod:`s3kv.storage.s3`); it is loaded
only when a KMS key source is configured or ``s3kv keys new --kms-key`` runs. Failures are
configuration problems (the engine cannot get its keys), so they become one-line
:class:`~s3kv.errors.ConfigError` messages naming ``auth_keys`` and the fix.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

import boto3
import botocore.exceptions as bce

from s3kv._logsetup import install_redaction
from s3kv.errors import ConfigError

_FOREIGN = (bce.BotoCoreError, bce.ClientError)


def _client(region: str | None) -> Any:
    install_redaction()  # NOTE: botocore logs KMS replies (plaintext data keys) at DEBUG
    try:
        return boto3.session.Session().client("kms", region_name=region or None)
    except _FOREIGN as exc:
        raise ConfigError(f"auth_keys: cannot open AWS KMS: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    if isinstance(exc, bce.ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code', 'error')}: {error.get('Message', '')}".rstrip(": ")
    return str(exc).splitlines()[0]


def kms_decrypt(ciphertexts: Sequence[str], *, region: str | None = None) -> list[bytes]:
    """Decrypt base64 KMS ciphertexts (data keys) with the credential chain's identity.

    Raises:
        ConfigError: Not base64, or KMS refused (names the entry and the fix).
    """
    client = _client(region)
    keys = []
    for number, text in enumerate(ciphertexts, start=1):
        try:
            blob = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ConfigError(f"auth_keys: data key {number} is not base64") from None
        try:
            keys.append(bytes(client.decrypt(CiphertextBlob=blob)["Plaintext"]))
        except _FOREIGN as exc:
            raise ConfigError(
                f"auth_keys: KMS did not decrypt data key {number} ({_reason(exc)}); the "
                "engine's role needs kms:Decrypt on the key that encrypted it"
            ) from None
    return keys


def kms_generate(key_arn: str, *, region: str | None = None) -> str:
    """A new 32-byte data key under ``key_arn``, as base64 ciphertext (the plaintext is
    dropped: engines decrypt it at startup).

    Raises:
        ConfigError: KMS refused (names the fix).
    """
    try:
        reply = _client(region).generate_data_key_without_plaintext(
            KeyId=key_arn, KeySpec="AES_256"
        )
    except _FOREIGN as exc:
        raise ConfigError(
            f"--kms-key: KMS did not generate a data key ({_reason(exc)}); you need "
            "kms:GenerateDataKeyWithoutPlaintext on that key"
        ) from None
    return base64.b64encode(reply["CiphertextBlob"]).decode("ascii")


__all__ = ["kms_decrypt", "kms_generate"]
