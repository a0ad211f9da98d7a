"""Where the keys come from: the ``auth_keys`` setting names a source, never a secret.

* ``file:/etc/s3kv/keys``: a key list (:mod:`s3kv.auth.keyring`). Readable by the group or
  others is refused: a secret there is no secret.
* ``env:S3KV_BLOCK_KEYS``: a key list in that environment variable (lines, or entries
  separated by ``;``). Under TensorRT-LLM only ``TLLM*``/``TRTLLM*`` variables reach the MPI
  workers, so name one such (for example ``TLLM_S3KV_KEYS_SECRET``).
* ``kms:/etc/s3kv/data-keys``: a list of ``KEY_ID CIPHERTEXT`` lines, each ciphertext a
  32-byte data key encrypted under an AWS KMS key (``aws kms generate-data-key --key-spec
  AES_256``, or ``s3kv keys new --kms-key ARN``). s3kv decrypts them once at startup with
  the credential chain's identity; the file alone is useless without ``kms:Decrypt``.

None of them is ever written to the bucket or to a log line.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from s3kv.auth.keyring import Keyring, parse_keys
from s3kv.errors import ConfigError

#: Decrypts KMS ciphertexts (base64 text) into data keys; injectable for tests.
KmsDecrypt = Callable[[Sequence[str]], list[bytes]]
SETTING = "auth_keys"


def load_keyring(
    spec: str,
    *,
    accept_unsigned: bool = False,
    environ: Mapping[str, str] | None = None,
    kms_decrypt: KmsDecrypt | None = None,
    region: str | None = None,
) -> Keyring | None:
    """Resolve the ``auth_keys`` setting into a keyring (None when it is empty).

    Raises:
        ConfigError: An unknown scheme, an unreadable or too open file, an unset variable, a
            malformed key list, or a KMS failure; one line naming ``auth_keys`` and the fix.
    """
    spec = spec.strip()
    if not spec:
        if accept_unsigned:
            raise ConfigError("auth_accept_unsigned: only means something with auth_keys set")
        return None
    scheme, sep, rest = spec.partition(":")
    if not sep or not rest.strip():
        raise ConfigError(f"{SETTING}: expected file:PATH, env:VARIABLE or kms:PATH, got {spec!r}")
    rest = rest.strip()
    if scheme == "file":
        source = f"{SETTING} (file {rest})"
        return parse_keys(_read_private(Path(rest)), source=source, accept_unsigned=accept_unsigned)
    if scheme == "env":
        env = os.environ if environ is None else environ
        if rest not in env:
            raise ConfigError(f"{SETTING}: environment variable {rest} is not set")
        text = env[rest].replace(";", "\n")
        return parse_keys(text, source=f"{SETTING} (env {rest})", accept_unsigned=accept_unsigned)
    if scheme == "kms":
        return _from_kms(Path(rest), accept_unsigned, kms_decrypt, region)
    raise ConfigError(
        f"{SETTING}: unknown source {scheme!r}; expected file:PATH, env:VARIABLE or kms:PATH"
    )


def _read_private(path: Path) -> str:
    try:
        info = path.stat()
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"{SETTING}: {path} is readable by others (mode {stat.filemode(info.st_mode)}); "
                f"run chmod 600 {path}"
            )
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{SETTING}: cannot read {path}: {exc.strerror}; fix the path") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{SETTING}: {path} is not a text key list") from None


def _from_kms(
    path: Path, accept_unsigned: bool, kms_decrypt: KmsDecrypt | None, region: str | None
) -> Keyring:
    try:
        lines = [
            line.split("#", 1)[0].split() for line in path.read_text(encoding="utf-8").splitlines()
        ]
    except OSError as exc:
        raise ConfigError(f"{SETTING}: cannot read {path}: {exc.strerror}; fix the path") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{SETTING}: {path} is not a text list of data keys") from None
    entries = [parts for parts in lines if parts]
    if not entries or any(len(parts) != 2 for parts in entries):
        raise ConfigError(
            f"{SETTING}: {path} must list 'KEY_ID CIPHERTEXT' lines "
            "(make one with `s3kv keys new --kms-key ARN`)"
        )
    if kms_decrypt is None:
        from s3kv.storage import kms_decrypt as decrypt

        def kms_decrypt(ciphertexts: Sequence[str]) -> list[bytes]:
            return decrypt(ciphertexts, region=region)

    plaintexts = kms_decrypt([ciphertext for _, ciphertext in entries])
    text = "\n".join(
        f"{key_id} {key.hex()}" for (key_id, _), key in zip(entries, plaintexts, strict=True)
    )
    return parse_keys(text, source=f"{SETTING} (kms {path})", accept_unsigned=accept_unsigned)


__all__ = ["KmsDecrypt", "load_keyring"]
