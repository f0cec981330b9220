"""The deployment's checkpoint signing key: an Ed25519 key in a file, made once.

The engine signs every checkpoint (engine/core/checkpoints.py) with this key. It is generated at the
first start into `<data dir>/checkpoint-key.pem` (or TRELLIS_CHECKPOINT_KEY, in a folder that
is there: a missing one is refused, not made), a PKCS#8 PEM file readable by its owner only
(0600), and never leaves that file: clients get the public half as a C2SP verifier key (the
`checkpoint-key` query), also written beside it in `<key file>.pub` for operators who hand it
to auditors out of band. Engines of one deployment
share the file, so every checkpoint of the deployment verifies with the same key.

Two engines starting at once on one data dir both end up with the key that reached the disk
first: the file is written under a temporary name and linked into place, which fails for the
second, and that one reads the first's.

A key made by a start whose log already holds signed checkpoints is the deployment's key lost or
replaced (a data dir not mounted, TRELLIS_CHECKPOINT_KEY pointing elsewhere): every older note
then stops verifying with the key auditors are told to use. `judge_new_key` refuses that start
and removes the key it made, unless TRELLIS_NEW_CHECKPOINT_KEY says the old key is gone for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from trellis.engine.core.checkpoints import KEY_NAME, Signer

log = logging.getLogger(__name__)

KEY_FILE = "checkpoint-key.pem"
#: Set (to 1) for a start that may make a new key although the log holds checkpoints signed by
#: other keys: the deployment's key is lost for good, or replaced on purpose.
NEW_KEY_ENV = "TRELLIS_NEW_CHECKPOINT_KEY"


class KeyFileError(RuntimeError):
    """The key file exists but holds no Ed25519 private key, or cannot be read or written."""


def public_key_path(path: Path) -> Path:
    return path.with_name(path.name + ".pub")


def load_or_create(path: Path, name: str = KEY_NAME, *, make_folder: bool = False) -> Signer:
    """The signer of the key in `path`, generated there first when there is none. Its folder
    is made too only with `make_folder` (the data dir's default place): a folder that is not
    there is a mistyped TRELLIS_CHECKPOINT_KEY, where a new key would be another deployment's.

    Raises:
        KeyFileError: the file is unreadable or holds something else, or (without
            `make_folder`) there is none and its folder is not there either.
    """
    try:
        if not path.exists():
            if not (make_folder or path.parent.is_dir()):
                raise KeyFileError(
                    f"checkpoint key {path}: there is no folder {path.parent} to make it in "
                    "(only the key file is made at the first start: is the path mistyped?)"
                )
            _create(path, make_folder)
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise KeyFileError(f"checkpoint key {path} is not an Ed25519 key")
        # Only once it is known to be a key: a path given by mistake (a directory, another
        # file) was made 0600 before it was found to be no key.
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("checkpoint key %s was readable by others (%o); made it 0600", path, mode)
            path.chmod(0o600)
    except OSError as exc:
        raise KeyFileError(f"checkpoint key {path}: {exc}") from None
    except ValueError as exc:
        raise KeyFileError(f"checkpoint key {path} holds no usable key: {exc}") from None
    signer = Signer(key.private_bytes_raw(), name)
    _write_public(path, signer)
    return signer


def judge_new_key(
    path: Path, signer: Signer, signed: Mapping[str, int], *, allowed: bool
) -> str | None:
    """What to say of the key this start made in `path`, given the key ids that sign the
    checkpoints the log holds and how many each (PostgresAuditTrail.signers).

    Returns:
        None when no other key signs any (a first start); else, when `allowed`, the warning
        for the operator.

    Raises:
        KeyFileError: other keys sign the log's checkpoints and a new key is not `allowed`. The
            key made is removed first, so that the next start judges again.
    """
    others = {key_id: n for key_id, n in signed.items() if key_id != signer.verifier.key_id}
    if not others:
        return None
    by = ", ".join(f"{key_id} ({n})" for key_id, n in sorted(others.items()))
    if not allowed:
        path.unlink(missing_ok=True)
        public_key_path(path).unlink(missing_ok=True)
        raise KeyFileError(
            f"there was no checkpoint key {path}, but the log holds checkpoints signed by "
            f"other keys, {by}: put the deployment's key back there (the data dir or "
            f"TRELLIS_CHECKPOINT_KEY may name the wrong place); only if it is lost for good, "
            f"start once with {NEW_KEY_ENV}=1 and give auditors the new verifier key"
        )
    message = (
        f"made a new checkpoint key {path} ({signer.verifier.key_id}) although the log holds "
        f"checkpoints signed by other keys, {by} ({NEW_KEY_ENV}): older notes verify only "
        "with their own key, newer ones only with the new verifier key"
    )
    log.warning("%s", message)
    return message


def judge_kept_key(path: Path, signer: Signer, signed: Mapping[str, int]) -> str | None:
    """What to say of a key found in `path` that signs none of the log's checkpoints while
    other keys sign some: another deployment's key, or the wrong TRELLIS_CHECKPOINT_KEY (a
    key rotated with TRELLIS_NEW_CHECKPOINT_KEY=1 says so too, until its first checkpoint).
    Not refused: the key is the operator's, and may be meant. None when it signs some, or
    none are signed."""
    own = signer.verifier.key_id
    if not signed or own in signed:
        return None
    by = ", ".join(f"{key_id} ({n})" for key_id, n in sorted(signed.items()))
    message = (
        f"the checkpoint key {path} ({own}) signs none of the log's checkpoints, which {by} "
        "sign: if this is not a deliberate rotation, stop and put the deployment's key there "
        "(the data dir or TRELLIS_CHECKPOINT_KEY may name the wrong place)"
    )
    log.warning("%s", message)
    return message


def _create(path: Path, make_folder: bool) -> None:
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another engine's key got there first
            os.link(temporary, path)
            # Info, not a warning: `trellis up` says it as a line of its banner.
            log.info("generated the checkpoint signing key %s", path)
    finally:
        temporary.unlink(missing_ok=True)


def _write_public(path: Path, signer: Signer) -> None:
    """`<key file>.pub`: the verifier key, for auditors (public, so 0644)."""
    pub = public_key_path(path)
    text = signer.verifier.key() + "\n"
    with contextlib.suppress(OSError):  # a read-only data dir: the query still answers it
        if not pub.exists() or pub.read_text() != text:
            pub.write_text(text)
            pub.chmod(0o644)
