"""Token files are checked when opened (check_token_file) and per sample: a wrong file is a one-line
ConfigError naming train.data.path, never garbage training."""

from __future__ import annotations

import numpy as np
import pytest

from spartron.runtime.config import ConfigError
from spartron.runtime.data import MmapTokens, check_token_file


def _tokens(path, values, dtype="uint16"):
    np.asarray(values, dtype=dtype).tofile(path)
    return path


def _bad_file(kind, d):
    if kind == "missing":
        return d / "missing.bin"
    if kind == "directory":
        return d
    path = d / f"{kind}.bin"
    path.write_bytes({"empty": b"", "odd": b"\x01\x00\x02", "short": np.arange(8, dtype=np.uint16).tobytes()}[kind])
    return path


@pytest.mark.parametrize("kind, message", [
    ("missing", "does not exist"),
    ("directory", "is not a regular file"),
    ("empty", "is empty"),
    ("odd", "has 3 bytes, not a multiple of 2 (train.data.token_dtype = 'uint16'): wrong dtype or a truncated file"),
    ("short", "holds 8 tokens, fewer than train.seq_len + 1 = 9"),
])
def test_bad_files_name_the_path(tmp_path, kind, message):
    path = _bad_file(kind, tmp_path)
    with pytest.raises(ConfigError) as info:
        check_token_file(path, "uint16", 8, 100)
    assert str(info.value) == f"train.data.path {str(path)!r} {message}"


def test_uint16_file_read_as_uint32_is_caught(tmp_path):
    path = _tokens(tmp_path / "u16.bin", [1, 2] * 64)  # ids 1, 2 as uint16 read as uint32: 2 * 65536 + 1
    with pytest.raises(ConfigError, match=r"contains token id 131073 >= model.vocab_size 100 \(first at token 0; "
                                          r"wrong train.data.token_dtype or vocabulary\?\)"):
        check_token_file(path, "uint32", 8, 100)
    assert len(check_token_file(path, "uint16", 8, 100)) == 128


def test_out_of_vocabulary_ids_far_past_the_first_mebi_token_are_found(tmp_path):
    n = 3 << 20
    values = np.zeros(n, dtype=np.uint16)
    values[n - 1] = 500  # only the last token is bad: beyond the head the old check read
    path = _tokens(tmp_path / "tail.bin", values)
    with pytest.raises(ConfigError, match=f"contains token id 500 >= model.vocab_size 100 \\(first at token {n - 1};"):
        check_token_file(path, "uint16", 8, 100)
    values[n - 1], values[(n * 5) // 9] = 0, 700  # somewhere in the middle
    path = _tokens(tmp_path / "middle.bin", values)
    with pytest.raises(ConfigError, match=f"token id 700 >= model.vocab_size 100 \\(first at token {(n * 5) // 9};"):
        check_token_file(path, "uint16", 8, 100)


def test_a_bad_id_between_the_checked_windows_is_caught_when_its_sample_is_read(tmp_path):
    n = 8 << 20  # 8 Mi tokens: the head (1 Mi) and 64 windows of 64 Ki leave gaps
    step = (n - (1 << 16)) / 63
    bad = int(10 * step) + (1 << 16) + 1000  # after window 10, before window 11
    assert bad < int(11 * step)
    values = np.zeros(n, dtype=np.uint16)
    values[bad] = 999
    path = _tokens(tmp_path / "big.bin", values)
    source = MmapTokens(path, "uint16", 8, 100)  # opening passes: the id is in no checked window
    assert source.sample(0).tolist() == [0] * 9
    k = bad // 8
    with pytest.raises(ConfigError, match=rf"sample {k} \(tokens from {k * 8}\) holds token id 999 >= "
                                          r"model.vocab_size 100"):
        source.sample(k)


def test_a_uint32_file_read_as_uint16_is_caught(tmp_path):
    path = _tokens(tmp_path / "u32.bin", np.arange(1, 200) % 90 + 1, dtype="uint32")
    with pytest.raises(ConfigError, match=r"every second token id is 0, as when a uint32 file is read as uint16"):
        check_token_file(path, "uint16", 8, 100)
    assert len(check_token_file(path, "uint32", 8, 100)) == 199
