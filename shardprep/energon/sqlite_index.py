"""``index.sqlite`` with energon 7.4's schema: rows of scanned tars, ``.tar.idx`` bytes from rows, and
the check that an existing database is the one we wrote last (so it can be updated, not rebuilt)."""

from __future__ import annotations

import os
import sqlite3
from array import array

from shardprep import storage
from shardprep.energon.format import INDEX_SQLITE, INDEX_UUID, META_DIR, EnergonIndexError
from shardprep.energon.scan import TarScan

# energon 7.4's SqliteIndexWriter schema
SCHEMA = (
    """
    CREATE TABLE IF NOT EXISTS samples (
        tar_file_id INTEGER NOT NULL,
        sample_key TEXT NOT NULL UNIQUE,
        sample_index INTEGER NOT NULL,
        byte_offset INTEGER,
        byte_size INTEGER
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS sample_parts (
        tar_file_id INTEGER,
        sample_index INTEGER,
        part_name TEXT,
        content_byte_offset INTEGER,
        content_byte_size INTEGER
    )
    """,
)
INDEXES = (
    "CREATE INDEX IF NOT EXISTS idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)",
    "CREATE INDEX IF NOT EXISTS idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name, "
    "content_byte_offset, content_byte_size)",
)
_BATCH = 4096


def create_schema(db: sqlite3.Connection) -> None:
    for stmt in SCHEMA:
        db.execute(stmt)


def create_indexes(db: sqlite3.Connection) -> None:
    for stmt in INDEXES:
        db.execute(stmt)


def drop_tars(db: sqlite3.Connection, tar_ids: list[int]) -> None:
    if not tar_ids:
        return
    marks = ",".join("?" * len(tar_ids))
    db.execute(f"DELETE FROM samples WHERE tar_file_id IN ({marks})", tar_ids)
    db.execute(f"DELETE FROM sample_parts WHERE tar_file_id IN ({marks})", tar_ids)


def move_tars(db: sqlite3.Connection, moves: list[tuple[int, int]]) -> None:
    """Renumber tars ``(old id, new id)``, through negative ids so a moved tar never collides with
    one not yet moved."""
    if not moves:
        return
    for table in ("samples", "sample_parts"):
        for old_id, new_id in moves:
            db.execute(f"UPDATE {table} SET tar_file_id = ? WHERE tar_file_id = ?", (-1 - new_id, old_id))
        db.execute(f"UPDATE {table} SET tar_file_id = -1 - tar_file_id WHERE tar_file_id < 0")


def insert_scan(db: sqlite3.Connection, tar_id: int, scan: TarScan, names: list[str], dataset_dir: str) -> None:
    """Insert one tar's rows; a key another tar already holds raises, naming both tars."""
    rows = [(tar_id, key, i, scan.offsets[i], scan.offsets[i + 1] - scan.offsets[i]) for i, key in enumerate(scan.keys)]
    for start in range(0, len(rows), _BATCH):
        batch = rows[start:start + _BATCH]
        db.execute("SAVEPOINT shardprep_batch")
        try:
            db.executemany("INSERT INTO samples (tar_file_id, sample_key, sample_index, byte_offset, byte_size) "
                           "VALUES (?, ?, ?, ?, ?)", batch)
            db.execute("RELEASE SAVEPOINT shardprep_batch")
        except sqlite3.IntegrityError:
            # executemany keeps the rows before the failing one: undo them, then find the older holder
            db.execute("ROLLBACK TO SAVEPOINT shardprep_batch")
            db.execute("RELEASE SAVEPOINT shardprep_batch")
            for row in batch:
                hit = db.execute("SELECT tar_file_id FROM samples WHERE sample_key = ?", (row[1],)).fetchone()
                if hit is not None:
                    raise EnergonIndexError(
                        f"duplicate sample key {row[1]!r}: in {storage.join(dataset_dir, scan.name)} and in "
                        f"{storage.join(dataset_dir, names[hit[0]])}; energon needs keys unique across the dataset "
                        "(energon prepare aborts)") from None
            raise
    db.executemany("INSERT INTO sample_parts (tar_file_id, sample_index, part_name, content_byte_offset, "
                   "content_byte_size) VALUES (?, ?, ?, ?, ?)", ((tar_id, *p) for p in scan.parts))


def new_generation(db: sqlite3.Connection) -> int:
    """Stamp the database with a fresh generation number (``PRAGMA user_version``, which energon never
    sets) and return it."""
    generation = int.from_bytes(os.urandom(4), "big") & 0x7FFFFFFF or 1
    db.execute(f"PRAGMA user_version = {generation}")
    return generation


def idx_from_sqlite(db: sqlite3.Connection, tar_id: int) -> bytes:
    """A tar's ``.tar.idx`` bytes rebuilt from its rows (no rescan)."""
    rows = db.execute("SELECT byte_offset, byte_size FROM samples WHERE tar_file_id = ? ORDER BY sample_index",
                      (tar_id,)).fetchall()
    offsets = array("Q", [r[0] for r in rows] + [rows[-1][0] + rows[-1][1]])
    return offsets.tobytes()


def sqlite_generation(path: str) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(db.execute("PRAGMA user_version").fetchone()[0])
    finally:
        db.close()


def load_trusted_sqlite(dataset_dir: str, state: dict | None, dest: str) -> bool:
    """Copy the existing sqlite to the local path ``dest`` if our state describes it; False means:
    rebuild from scratch.

    Trusted only when ``index.uuid`` is the uuid we wrote last and the sqlite carries our generation
    number: a crash mid-update or a later ``energon prepare`` (new uuid) breaks one of the two.
    """
    if state is None or not state.get("uuid"):
        return False
    current_uuid = storage.read_text(storage.join(dataset_dir, META_DIR, INDEX_UUID))
    if current_uuid is None or current_uuid.strip() != state["uuid"]:
        return False
    sqlite_url = storage.join(dataset_dir, META_DIR, INDEX_SQLITE)
    if not storage.exists(sqlite_url):
        return False
    storage.fetch_file(sqlite_url, dest)
    if sqlite_generation(dest) != state.get("generation"):
        os.remove(dest)
        return False
    return True
