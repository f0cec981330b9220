"""The schema folder the migrations come from: a folder that is missing or holds none says so,
naming TRELLIS_SCHEMA_DIR when that is where it came from. (An empty one migrated nothing, and
the first look at the tables then blamed the role's privileges.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from trellis.adapters.postgres.migrations import SCHEMA_DIR, MigrationError, migration_files


def test_the_packaged_schema_holds_the_migrations_in_order() -> None:
    versions = [version for version, _ in migration_files()]
    assert versions and versions == sorted(versions) and versions[0] == 1
    assert SCHEMA_DIR.is_dir()


@pytest.mark.parametrize("kind", ["missing", "empty"])
def test_a_folder_without_migrations_is_an_error_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    folder = tmp_path / "schema"
    if kind == "empty":
        folder.mkdir()
        (folder / "README.md").write_text("not a migration\n")
    monkeypatch.setenv("TRELLIS_SCHEMA_DIR", str(folder))
    with pytest.raises(MigrationError) as refused:
        migration_files(folder)
    said = str(refused.value)
    assert f"{folder} (TRELLIS_SCHEMA_DIR)" in said
    assert ("not found" if kind == "missing" else "holds no migrations") in said
