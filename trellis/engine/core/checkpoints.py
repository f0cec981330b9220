"""Signed checkpoints: C2SP `tlog-checkpoint` bodies in C2SP signed notes, with Ed25519.

Standards, so tools that check other transparency logs (Go's sumdb/note, sigsum, the
transparency-dev witnesses) can check ours (ARCHITECTURE §6 "Encodings"):

- A checkpoint body is three lines, each ending in a newline: the origin (`trellis/<domain>`),
  the tree size in decimal, and the base64 (standard, padded) RFC 9162 root hash.
- A signed note is the body, a blank line, and one line per signature:
  `— <key name> <base64(key hash (4 bytes) || signature)>`, the em dash U+2014 and a space
  first. The Ed25519 signature covers the body, final newline included.
- The key hash is the first 4 bytes of `SHA-256(key name || 0x0A || 0x01 || public key)`
  (0x01: the Ed25519 signature type) and the verifier key, the text an auditor needs and
  nothing more, is `<name>+<8 hex digits of the key hash>+<base64(0x01 || public key)>`.

Ed25519 signatures are deterministic, so signing the same checkpoint twice gives the same
note byte for byte (a retried publication is a true duplicate). Pure: no I/O, the private key
comes in as bytes.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import re
from collections.abc import Iterable

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trellis.engine.core.merkle import HASH_SIZE

KEY_NAME = "trellis"
ORIGIN_PREFIX = "trellis/"
_ED25519 = b"\x01"
_DASH = "\u2014 "
MAX_NOTE_BYTES = 1 << 16
# C2SP: a key name is non-empty and has neither Unicode spaces nor "+".
_NAME = re.compile(r"[^\s+]+")


class NoteError(ValueError):
    """A checkpoint, note or verifier key that is malformed, or not signed by the key."""


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A tree head: the tree of `size` leaves of the log named `origin` has root `root`."""

    origin: str
    size: int
    root: bytes

    def body(self) -> str:
        """The C2SP tlog-checkpoint text (newline-terminated)."""
        return f"{self.origin}\n{self.size}\n{base64.b64encode(self.root).decode()}\n"


def origin_of(domain: str) -> str:
    return f"{ORIGIN_PREFIX}{domain}"


def parse_checkpoint(body: str) -> Checkpoint:
    """The checkpoint a note's text holds (extension lines after the third are allowed).

    Raises:
        NoteError: it is not a tlog-checkpoint body.
    """
    if not body.endswith("\n"):
        raise NoteError("a checkpoint ends with a newline")
    lines = body[:-1].split("\n")
    if len(lines) < 3 or not lines[0]:
        raise NoteError("a checkpoint has an origin, a tree size and a root hash line")
    origin, size_text, root_text = lines[:3]
    if not re.fullmatch(r"0|[1-9][0-9]{0,18}", size_text):
        raise NoteError(f"tree size {size_text!r} is not a decimal number")
    root = _b64(root_text, "root hash")
    if len(root) != HASH_SIZE:
        raise NoteError(f"the root hash has {len(root)} bytes, not {HASH_SIZE}")
    return Checkpoint(origin=origin, size=int(size_text), root=root)


def key_hash(name: str, public_key: bytes) -> bytes:
    """C2SP's 4-byte key hash of an Ed25519 key: SHA-256(name || 0x0A || 0x01 || key)[:4]."""
    return hashlib.sha256(name.encode() + b"\n" + _ED25519 + public_key).digest()[:4]


class Verifier(msgspec.Struct, frozen=True):
    """A C2SP note verifier: a key name and an Ed25519 public key."""

    name: str
    public_key: bytes

    @property
    def key_hash(self) -> bytes:
        return key_hash(self.name, self.public_key)

    @property
    def key_id(self) -> str:
        """`<name>+<hex key hash>`: the key as a note's signature line names it."""
        return f"{self.name}+{self.key_hash.hex()}"

    def key(self) -> str:
        """The verifier key text: `<name>+<hex key hash>+<base64(0x01 || key)>`."""
        encoded = base64.b64encode(_ED25519 + self.public_key).decode()
        return f"{self.key_id}+{encoded}"

    @classmethod
    def parse(cls, text: str) -> Verifier:
        """Read a verifier key text; its key hash must be the key's.

        Raises:
            NoteError: malformed, not Ed25519, or a key hash that does not match.
        """
        parts = text.strip().split("+", 2)  # base64 may hold "+" too
        if len(parts) != 3 or not _NAME.fullmatch(parts[0]):
            raise NoteError("a verifier key reads <name>+<key hash>+<base64 key>")
        name, hash_text, key_text = parts
        key = _b64(key_text, "verifier key")
        if len(key) != 33 or key[:1] != _ED25519:
            raise NoteError("the verifier key is not an Ed25519 key (type 0x01, 32 bytes)")
        verifier = cls(name, key[1:])
        if hash_text.lower() != verifier.key_hash.hex() or len(hash_text) != 8:
            raise NoteError("the verifier key's hash does not match its key")
        return verifier

    def open(self, note: str) -> str:
        """The text of `note` when it carries a valid signature by this key.

        Raises:
            NoteError: malformed, not signed by this key, or a bad signature.
        """
        if len(note.encode()) > MAX_NOTE_BYTES:
            raise NoteError("the note is too large")
        text, signatures = _split(note)
        signed = False
        for line in signatures:
            if not line.startswith(_DASH):
                raise NoteError(f"not a signature line: {line[:40]!r}")
            name, _, encoded = line[len(_DASH) :].partition(" ")
            raw = _b64(encoded, "signature")
            if len(raw) < 5:
                raise NoteError("a signature line holds a key hash and a signature")
            if name != self.name or raw[:4] != self.key_hash:
                continue  # another signer's (a witness, say): not ours to judge
            try:
                Ed25519PublicKey.from_public_bytes(self.public_key).verify(raw[4:], text.encode())
            except InvalidSignature:
                # By key id: after a key rotation the old and the new key share a name.
                raise NoteError(f"the signature by {self.key_id} does not verify") from None
            signed = True
        if not signed:
            raise NoteError(f"the note carries no signature by {self.key()}")
        return text


class Signer:
    """Signs notes with an Ed25519 private key under a key name.

    Args:
        private_key: the 32-byte Ed25519 seed.
        name: the key name in the verifier key and on every signature line.
    """

    def __init__(self, private_key: bytes, name: str = KEY_NAME):
        if not _NAME.fullmatch(name):
            raise ValueError(f"key name {name!r} must be non-empty, without spaces or '+'")
        self._key = Ed25519PrivateKey.from_private_bytes(private_key)
        self.name = name
        self.verifier = Verifier(name, self._key.public_key().public_bytes_raw())

    @classmethod
    def generate(cls, name: str = KEY_NAME) -> Signer:
        return cls(Ed25519PrivateKey.generate().private_bytes_raw(), name)

    def sign(self, text: str) -> str:
        """`text` (newline-terminated, no blank line) as a note with this key's signature."""
        if not text.endswith("\n") or "\n\n" in text:
            raise ValueError("a note's text ends with a newline and holds no blank line")
        signature = self._key.sign(text.encode())
        encoded = base64.b64encode(self.verifier.key_hash + signature).decode()
        return f"{text}\n{_DASH}{self.name} {encoded}\n"

    def checkpoint(self, checkpoint: Checkpoint) -> str:
        """The signed note of `checkpoint`."""
        return self.sign(checkpoint.body())


def open_checkpoint(note: str, verifier: Verifier) -> Checkpoint:
    """The checkpoint in `note`, once its signature by `verifier` holds.

    Raises:
        NoteError: see `Verifier.open` and `parse_checkpoint`.
    """
    return parse_checkpoint(verifier.open(note))


def open_checkpoint_by_any(note: str, verifiers: Iterable[Verifier]) -> tuple[Checkpoint, Verifier]:
    """The checkpoint in `note` and the first of `verifiers` whose signature on it holds: after
    a key rotation a log's older notes carry the old key's signature and its newer ones the new
    key's. As C2SP note verifiers do with their known keys (Go's note.Open), a signature by one
    of `verifiers` that does not hold fails the note, even beside one that holds.

    Raises:
        NoteError: no verifier is given, none of them signed `note`, or the signature of one
            that did does not hold (with one verifier: what `open_checkpoint` raises).
    """
    opened: list[tuple[Checkpoint, Verifier]] = []
    failed: dict[Verifier, str] = {}
    for verifier in dict.fromkeys(verifiers):  # a key given twice is tried once
        try:
            opened.append((open_checkpoint(note, verifier), verifier))
        except NoteError as exc:
            failed[verifier] = str(exc)
    signed = signers_of(note)
    broken = [why for verifier, why in failed.items() if verifier.key_id in signed]
    if opened and not broken:
        return opened[0]
    if not failed:
        raise NoteError("no verifier key to check the note with")
    raise NoteError("; ".join(dict.fromkeys(broken or failed.values())))


def stated(note: str) -> Checkpoint:
    """The checkpoint `note` states, its signatures unchecked (the reader's, with its key).

    Raises:
        NoteError: it is no signed note of a checkpoint.
    """
    text, _ = _split(note)
    return parse_checkpoint(text)


def _split(note: str) -> tuple[str, list[str]]:
    """A signed note's text (newline-terminated) and its signature lines.

    Raises:
        NoteError: it is not a text, a blank line and signature lines.
    """
    split = note.rfind("\n\n")
    if split < 0 or not note.endswith("\n"):
        raise NoteError("a signed note is its text, a blank line and signature lines")
    return note[: split + 1], note[split + 2 : -1].split("\n")


def signers_of(note: str) -> set[str]:
    """The key ids (`<name>+<hex key hash>`, as `Verifier.key_id`) that `note`'s signature
    lines name, whether or not each signature holds; a line that is no signature is passed
    over."""
    key_ids = set()
    for line in note[note.rfind("\n\n") + 2 :].splitlines():
        if not line.startswith(_DASH):
            continue
        name, _, encoded = line.removeprefix(_DASH).partition(" ")
        with contextlib.suppress(NoteError):
            key_hash = _b64(encoded, "signature")[:4]
            if len(key_hash) == 4:
                key_ids.add(f"{name}+{key_hash.hex()}")
    return key_ids


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise NoteError(f"the {what} is not base64") from None
