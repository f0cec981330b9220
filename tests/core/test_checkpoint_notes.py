"""engine/core/checkpoints.py: C2SP checkpoints in signed notes, checked with the verifier key
only."""

from __future__ import annotations

import base64

import pytest

from trellis.engine.core.checkpoints import (
    Checkpoint,
    NoteError,
    Signer,
    Verifier,
    key_hash,
    open_checkpoint,
    parse_checkpoint,
    signers_of,
)

# The example note and verifier key of the C2SP signed-note ecosystem (Go's sumdb/note
# documentation): data only, so our verifier is checked against a note someone else signed.
GO_NOTE_KEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
GO_NOTE = (
    "This is an example message.\n\n"
    "\u2014 example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3"
    "mFXmRKuwHjG1Yu72IneyaQM=\n"
)

ROOT = bytes(range(32))


def test_a_note_signed_elsewhere_opens_with_its_verifier_key() -> None:
    verifier = Verifier.parse(GO_NOTE_KEY)
    assert verifier.open(GO_NOTE) == "This is an example message.\n"
    assert verifier.key() == GO_NOTE_KEY


def test_a_checkpoint_is_three_lines_and_signed_by_the_key_it_names() -> None:
    signer = Signer(bytes(32))
    checkpoint = Checkpoint(origin="trellis/hall-1", size=42, root=ROOT)
    note = signer.checkpoint(checkpoint)
    body, _blank, line = note.partition("\n\n")
    assert body + "\n" == f"trellis/hall-1\n42\n{base64.b64encode(ROOT).decode()}\n"
    assert line.startswith("\u2014 trellis ") and line.endswith("\n")
    raw = base64.b64decode(line.split(" ")[2])
    assert raw[:4] == key_hash("trellis", signer.verifier.public_key) and len(raw) == 68
    key = signer.verifier.key()
    name, hash_hex, encoded = key.split("+", 2)
    assert (name, hash_hex) == ("trellis", raw[:4].hex())
    assert base64.b64decode(encoded)[0] == 1
    assert open_checkpoint(note, Verifier.parse(key)) == checkpoint
    assert signer.checkpoint(checkpoint) == note  # Ed25519 is deterministic


def test_a_tampered_body_fails() -> None:
    signer = Signer.generate()
    note = signer.checkpoint(Checkpoint(origin="trellis/d", size=7, root=ROOT))
    forged = note.replace("\n7\n", "\n8\n")
    with pytest.raises(NoteError, match="does not verify"):
        open_checkpoint(forged, signer.verifier)
    other_root = base64.b64encode(bytes(32)).decode()
    forged = note.replace(base64.b64encode(ROOT).decode(), other_root)
    with pytest.raises(NoteError, match="does not verify"):
        open_checkpoint(forged, signer.verifier)


def test_another_key_does_not_open_the_note() -> None:
    note = Signer.generate().checkpoint(Checkpoint(origin="trellis/d", size=7, root=ROOT))
    with pytest.raises(NoteError, match="no signature by"):
        open_checkpoint(note, Signer.generate().verifier)
    # The same name and key hash, but another public key: the signature fails.
    imposter = Signer.generate()
    with pytest.raises(NoteError):
        open_checkpoint(note, Verifier("trellis", imposter.verifier.public_key))


def test_a_signature_by_an_unknown_key_is_ignored_beside_ours() -> None:
    ours, witness = Signer.generate(), Signer.generate("witness.example")
    note = ours.checkpoint(Checkpoint(origin="trellis/d", size=1, root=ROOT))
    cosigned = note + witness.sign(note.partition("\n\n")[0] + "\n").partition("\n\n")[2]
    assert open_checkpoint(cosigned, ours.verifier).size == 1


@pytest.mark.parametrize(
    "key",
    [
        "trellis",
        "trellis+00000000",
        "trellis+zz+AQ==",
        "tre llis+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k",
        "example.com/foo+530d903b+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k",  # wrong hash
        "example.com/foo+530d903a+AkyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k",  # not base64
    ],
)
def test_malformed_verifier_keys_are_refused(key: str) -> None:
    with pytest.raises(NoteError):
        Verifier.parse(key)


@pytest.mark.parametrize(
    "body",
    [
        "trellis/d\n7\n",
        "trellis/d\nseven\nAAAA\n",
        "trellis/d\n07\n" + base64.b64encode(ROOT).decode() + "\n",
        "trellis/d\n7\n" + base64.b64encode(ROOT[:31]).decode() + "\n",
        "trellis/d\n7\n" + base64.b64encode(ROOT).decode(),
    ],
)
def test_malformed_checkpoints_are_refused(body: str) -> None:
    with pytest.raises(NoteError):
        parse_checkpoint(body)


def test_malformed_notes_are_refused() -> None:
    verifier = Signer.generate().verifier
    for note in ["no blank line\n", "text\n\nnot a signature\n", "text\n\n\u2014 trellis !!\n"]:
        with pytest.raises(NoteError):
            verifier.open(note)


def test_a_notes_signers_are_the_key_ids_its_signature_lines_name() -> None:
    deployment, witness = Signer.generate(), Signer.generate("witness")
    body = Checkpoint(origin="trellis/hall-1", size=3, root=bytes(32)).body()
    note = deployment.sign(body) + witness.sign(body).rpartition("\n\n")[2]
    assert signers_of(note) == {deployment.verifier.key_id, witness.verifier.key_id}
    assert deployment.verifier.key().startswith(deployment.verifier.key_id + "+")
    assert signers_of(body + "\nno signature line\n\u2014 x not-base64\n") == set()
