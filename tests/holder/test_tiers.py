"""The disk tier: atomic files, verified reads, and a rescan that drops what fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsp.core.problems import DigestError
from kvsp.holder.blocks import BlockMeta
from kvsp.holder.tiers import DiskTier
from tests.holder.factories import block_id, stored


def test_write_read_scan(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    meta, data, _ = stored(1)
    disk.write(block_id(1), meta, (0, 3), [data[:100], data[100:]])
    assert bytes(disk.read(block_id(1), meta, (0, 3), (1, 2))) == bytes(
        data[meta.offsets[1] : meta.offsets[3]]
    )
    (found,) = list(disk.scan())
    assert (found.block, found.meta, found.span) == (block_id(1), meta, (0, 3))
    disk.delete(block_id(1))
    assert list(disk.scan()) == []


def test_a_flipped_byte_is_found_on_read_and_on_scan(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    meta, data, _ = stored(1)
    lo = meta.offsets[2]
    disk.write(block_id(1), meta, (2, 3), [data[lo:]])
    path = disk.path(block_id(1))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    assert bytes(disk.read(block_id(1), meta, (2, 3), (2, 2)))  # layer 2 is intact
    with pytest.raises(DigestError):
        disk.read(block_id(1), meta, (2, 3), (3, 3))
    (found,) = list(disk.scan())
    assert found.meta is None
    assert found.block == block_id(1)
    assert "layer 3" in (found.problem or "")
    assert not path.exists()


@pytest.mark.parametrize("damage", ["truncate", "header", "magic"])
def test_damaged_files_are_removed_on_scan(tmp_path: Path, damage: str) -> None:
    disk = DiskTier(tmp_path)
    meta, data, _ = stored(1)
    disk.write(block_id(1), meta, (0, 3), [data])
    path = disk.path(block_id(1))
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[:-1])
    elif damage == "header":
        path.write_bytes(raw[:20] + b"}" + raw[21:])
    else:
        path.write_bytes(b"X" + raw[1:])
    (found,) = list(disk.scan())
    assert found.meta is None
    assert not path.exists()


def test_leftover_temporary_and_stray_files_are_removed(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path)
    meta, data, _ = stored(1)
    disk.write(block_id(1), meta, (0, 3), [data])
    path = disk.path(block_id(1))
    temp = path.with_name(path.name + ".tmp-abc")
    temp.write_bytes(b"half")
    stray = path.parent / "not-a-block.kvsp"
    stray.write_bytes(b"?")
    assert [f.block for f in disk.scan()] == [block_id(1)]
    assert not temp.exists()
    assert not stray.exists()


def test_meta_json_roundtrip_and_rejects() -> None:
    meta = stored(1)[0]
    assert BlockMeta.from_json(__import__("json").dumps(meta.to_json())) == meta
    from kvsp.core.problems import RecordError

    for bad in (
        "{",
        '{"codec": 1}',
        '{"codec":1,"token_count":1,"lengths":[[1,1]],"layer_digests":["00"]}',
    ):
        with pytest.raises(RecordError):
            BlockMeta.from_json(bad)
