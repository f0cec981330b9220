"""`trellis verify --checkpoint --proof`, the offline proof check, on its command line: what an
auditor types wrong is told as such (docs/auditing.md, "Check them offline")."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import pytest

from trellis.adapters.entrypoints import cli
from trellis.adapters.entrypoints.audit_proofs import ProofRejected, check
from trellis.engine.core.checkpoints import Checkpoint, Signer
from trellis.engine.core.merkle import MerkleTree, leaf_hash

HASHES = [hashlib.sha256(bytes([i])).hexdigest() for i in range(5)]


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A signed checkpoint of five events, an inclusion proof of the third, and the key."""
    tree = MerkleTree(leaf_hash(bytes.fromhex(h)) for h in HASHES)
    signer = Signer.generate()
    note = signer.checkpoint(Checkpoint(origin="trellis/hall-1", size=5, root=tree.root()))
    proof = {
        "leaf_index": 2,
        "tree_size": 5,
        "root": b64(tree.root()),
        "path": [b64(p) for p in tree.inclusion_path(2)],
        "checkpoint": note,
    }
    paths = {name: tmp_path / name for name in ("note", "proof.json", "key")}
    paths["note"].write_text(note)
    paths["proof.json"].write_text(json.dumps(proof))
    paths["key"].write_text(signer.verifier.key() + "\n")
    return paths


def verify(files: dict[str, Path], *, leave_out: str = "", **more: str) -> list[str]:
    given = {
        "--checkpoint": files["note"],
        "--proof": files["proof.json"],
        "--key-file": files["key"],
    }
    args = ["verify"]
    for flag, path in given.items():
        if flag != leave_out:
            args += [flag, str(path)]
    for flag, value in more.items():
        args += [f"--{flag.replace('_', '-')}", value]
    return args


def test_the_proof_holds_with_every_part_given(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(verify(files, event_hash=HASHES[2])) == 0
    assert capsys.readouterr().out.startswith("ok: event hash ")


@pytest.mark.parametrize("bad", ["zz", f"sha256:{HASHES[2]}", HASHES[2][:-2], HASHES[2] + "00"])
def test_an_event_hash_that_is_not_64_hex_digits_is_a_usage_error_naming_it(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], bad: str
) -> None:
    assert cli.main(verify(files, event_hash=bad)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("trellis: usage: argument --event-hash: the event hash "), line
    assert "is not 64 hex digits" in line and "malformed" not in line
    # Called as a library, the argument is blamed too, not the proof file.
    proof = json.loads(files["proof.json"].read_text())
    key = files["key"].read_text().strip()
    with pytest.raises(ProofRejected, match=r"^the event hash .* is not 64 hex digits"):
        check([files["note"].read_text()], proof, key, event_hash=bad)


@pytest.mark.parametrize(
    ("leave_out", "named"),
    [
        ("--proof", "the proof (--proof FILE)"),
        ("--key-file", "the verifier key (--key KEY or --key-file FILE)"),
        ("--checkpoint", "a signed checkpoint (--checkpoint FILE)"),
    ],
)
def test_a_missing_proof_key_or_checkpoint_is_a_usage_error(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], leave_out: str, named: str
) -> None:
    assert cli.main(verify(files, leave_out=leave_out, event_hash=HASHES[2])) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"trellis: usage: an offline check needs {named} (hint: `trellis verify --help`)\n"
    )


def test_a_note_file_with_trailing_blank_lines_is_read_as_its_note(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    note = files["note"].read_text()
    files["note"].write_text(note + "\n\n")  # as an editor or `psql -At > file` leaves it
    assert cli.main(verify(files, event_hash=HASHES[2])) == 0, capsys.readouterr().err
    # The note itself (C2SP) still ends with its last signature line: only the file is lenient.
    key = files["key"].read_text().strip()
    proof = json.loads(files["proof.json"].read_text())
    with pytest.raises(ProofRejected, match="not a signature line"):
        check([note + "\n"], proof, key, event_hash=HASHES[2])


@pytest.mark.parametrize(
    ("which", "how"),
    [
        ("proof.json", "missing"),
        ("note", "missing"),
        ("key", "missing"),
        ("proof.json", "not json"),
    ],
)
def test_a_file_that_cannot_be_read_is_a_usage_error_not_a_failed_check(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], which: str, how: str
) -> None:
    # (A note or a key is text: what it says is checked, and fails as such.)
    if how == "missing":
        files[which].unlink()
    else:
        files[which].write_text("{not json")
    assert cli.main(verify(files, event_hash=HASHES[2])) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("trellis: usage: "), line
    assert str(files[which]) in line and "FAILED" not in line


@pytest.fixture
def rotated(tmp_path: Path) -> tuple[list[str], Signer, Signer]:
    """A key rotation between two checkpoints: the one of three events signed by the old key,
    the one of five by the new; the command line checking their consistency proof, less the
    keys, and the two signers."""
    tree = MerkleTree(leaf_hash(bytes.fromhex(h)) for h in HASHES)
    old, new = Signer.generate(), Signer.generate()
    for signer, size in ((old, 3), (new, 5)):
        checkpoint = Checkpoint(origin="trellis/hall-1", size=size, root=tree.root(size))
        (tmp_path / f"{size}.note").write_text(signer.checkpoint(checkpoint))
    proof = {
        "from_size": 3,
        "to_size": 5,
        "from_root": b64(tree.root(3)),
        "to_root": b64(tree.root(5)),
        "path": [b64(p) for p in tree.consistency_proof(3, 5)],
    }
    (tmp_path / "consistency.json").write_text(json.dumps(proof))
    (tmp_path / "old.vkey").write_text(old.verifier.key() + "\n")
    notes = [str(tmp_path / "3.note"), str(tmp_path / "5.note")]
    args = ["verify", "--checkpoint", notes[0], "--checkpoint", notes[1]]
    return [*args, "--proof", str(tmp_path / "consistency.json")], old, new


def test_after_a_key_rotation_each_note_holds_with_one_of_the_keys_given(
    rotated: tuple[list[str], Signer, Signer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, old, new = rotated
    new_key = ["--key", new.verifier.key()]
    # --key and --key-file mix: every key given is used, none ignored.
    both = [*args, "--key-file", str(tmp_path / "old.vkey"), *new_key]
    assert cli.main(both) == 0, capsys.readouterr().err
    signers = " and ".join(sorted([old.verifier.key_id, new.verifier.key_id]))
    assert capsys.readouterr().out.endswith(f"(signed checkpoints of 3 and 5 by {signers})\n")
    assert cli.main([*both, *new_key, "--key", old.verifier.key()]) == 0  # repeats are harmless

    # The old key alone, or the new: the other key's note fails.
    assert cli.main([*args, *new_key]) == 1
    assert capsys.readouterr().err == (
        f"trellis verify: FAILED: the note carries no signature by {new.verifier.key()}\n"
    )
    assert cli.main([*args, "--key-file", str(tmp_path / "old.vkey")]) == 1
    assert f"no signature by {old.verifier.key()}" in capsys.readouterr().err

    # A key that is no key is not passed over for the good ones: it is the command line's
    # mistake, exit 2 as a malformed --event-hash is (the auditor probe: it was exit 1).
    assert cli.main([*both, "--key", "trellis+00000000+AAAA"]) == 2
    assert "trellis: usage: 'trellis+00000000+AAAA' is no verifier key" in capsys.readouterr().err


def test_an_inclusion_proof_without_its_event_is_a_usage_error(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """An auditor's probe left out --event: exit 1 read as a proof that does not hold."""
    assert cli.main(verify(files)) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("trellis: usage: an inclusion proof is of an event: give --event"), line
