"""The hand-written safetensors reader against files written by the `safetensors` library."""

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from safetensors import SafetensorError, TensorSpec, serialize_file
from safetensors.numpy import load_file, save_file

from nvfp4_format.safetensors_file import load_safetensors, read_tensor, read_tensor_bytes
from nvfp4_format.safetensors_header import DTYPE_TAGS, read_safetensors_header
from nvfp4_format.safetensors_index import read_safetensors_index

TAG_OF_DTYPE = {
    np.float64: "F64",
    np.float32: "F32",
    np.float16: "F16",
    ml_dtypes.bfloat16: "BF16",
    np.int64: "I64",
    np.int32: "I32",
    np.int16: "I16",
    np.int8: "I8",
    np.uint64: "U64",
    np.uint32: "U32",
    np.uint16: "U16",
    np.uint8: "U8",
    np.bool_: "BOOL",
    ml_dtypes.float8_e4m3fn: "F8_E4M3",
    ml_dtypes.float8_e5m2: "F8_E5M2",
    ml_dtypes.float8_e8m0fnu: "F8_E8M0",
}


def _random(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    if dtype is np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype is ml_dtypes.float8_e8m0fnu:
        return rng.integers(100, 150, size=shape, dtype=np.uint8).view(dtype)
    return (rng.standard_normal(shape) * 10).astype(dtype)


def _write_raw(path, header, data: bytes = b"") -> str:
    """A safetensors file from an explicit header (dict or raw bytes) and data buffer."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


@pytest.fixture
def real_file(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"t_{tag}": _random(rng, dtype, (3, 5)) for dtype, tag in TAG_OF_DTYPE.items()}
    tensors["scalar"] = np.array(2.5, np.float32)
    tensors["empty"] = np.zeros((0, 7), np.float16)
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt", "producer": "test"})
    return path, tensors


def test_every_dtype_round_trips_from_a_safetensors_written_file(real_file):
    path, written = real_file
    tensors, metadata = load_safetensors(path)
    assert metadata == {"format": "pt", "producer": "test"}
    assert set(tensors) == set(written)
    for name, expected in written.items():
        got = tensors[name]
        assert got.dtype == expected.dtype, name
        assert got.shape == expected.shape, name
        assert got.tobytes() == expected.tobytes(), name
        assert not got.flags.writeable


def test_header_tags_and_offsets_match_the_library(real_file):
    path, written = real_file
    header = read_safetensors_header(path)
    assert header.file_bytes == os.path.getsize(path)
    for dtype, tag in TAG_OF_DTYPE.items():
        info = header.tensors[f"t_{tag}"]
        assert info.dtype == tag
        assert info.shape == (3, 5)
        assert info.nbytes == 15 * np.dtype(dtype).itemsize
        assert DTYPE_TAGS[tag] == np.dtype(dtype)
    with open(path, "rb") as f:
        raw = f.read()
    for name, info in header.tensors.items():
        assert raw[info.begin : info.end] == written[name].tobytes(), name
    # read agrees with the library's own loader (whose NumPy side knows no ml_dtypes types)
    native = {n: t for n, t in written.items() if hasattr(np, t.dtype.name)}
    assert len(native) == 14  # 12 NumPy-native tags, the scalar, the empty tensor
    save_file(native, path)
    header, library = read_safetensors_header(path), load_file(path)
    for name in native:
        assert read_tensor(header, name).tobytes() == library[name].tobytes()


def test_f4_tensor_written_by_the_library_comes_back_packed(tmp_path):
    packed = np.arange(8, dtype=np.uint8) * 17
    path = str(tmp_path / "f4.safetensors")
    # torch's float4_e2m1fn_x2 (two FP4 per byte): safetensors records logical shape [4, 4]
    spec = TensorSpec(
        dtype="float4_e2m1fn_x2", shape=(4, 2), data_ptr=packed.ctypes.data, data_len=8
    )
    serialize_file({"w": spec}, path, None)
    header = read_safetensors_header(path)
    assert header.tensors["w"].dtype == "F4"
    assert header.tensors["w"].shape == (4, 4)
    got = read_tensor(header, "w")
    assert got.dtype == np.uint8 and got.shape == (4, 2)
    np.testing.assert_array_equal(got, packed.reshape(4, 2))


def test_read_tensor_unknown_name(real_file):
    header = read_safetensors_header(real_file[0])
    with pytest.raises(KeyError, match="nope"):
        read_tensor(header, "nope")


def test_truncated_real_file_is_rejected(real_file):
    path, _ = real_file
    size = os.path.getsize(path)
    os.truncate(path, size - 3)
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        read_safetensors_header(path)
    with pytest.raises(SafetensorError):  # the reference library rejects it too
        load_file(path)


def test_file_truncated_inside_the_header(real_file):
    path, _ = real_file
    os.truncate(path, 20)
    with pytest.raises(ValueError, match="header length .* runs past the end of the 20-byte"):
        read_safetensors_header(path)


@pytest.mark.parametrize("size", [0, 5])
def test_file_shorter_than_8_bytes(tmp_path, size):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01" * size)
    with pytest.raises(ValueError, match=rf"tiny\.safetensors.*{size} bytes, shorter than"):
        read_safetensors_header(path)


def test_huge_header_length(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(ValueError, match="exceeds"):
        read_safetensors_header(path)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b"garbage!", "not valid JSON"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'{"a": 1, "a": 2}', "duplicate keys"),
        ({"x": [1]}, "entry must be an object"),
        ({"x": {"dtype": "F32", "shape": [1]}}, r"missing keys \['data_offsets'\]"),
        (
            {"x": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}},
            "unknown dtype tag 'F6_E2M3'",
        ),
        ({"x": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}}, "unknown dtype tag 'f32'"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "non-negative integers"),
        ({"x": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "non-negative"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, "begin <= end"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, "begin <= end"),
        (
            {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},
            r"shape \[2\] needs 8 bytes but data_offsets \[0, 4\] span 4",
        ),
        ({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, "odd element count 3"),
        ({"__metadata__": {"format": 1}}, "__metadata__ must be an object of strings"),
    ],
)
def test_malformed_headers(tmp_path, header, message):
    path = _write_raw(tmp_path / "bad.safetensors", header, b"\0" * 8)
    with pytest.raises(ValueError, match=message) as info:
        read_safetensors_header(path)
    assert "bad.safetensors" in str(info.value)


def _two_tensors(a_offsets, b_offsets):
    return {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": a_offsets},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": b_offsets},
    }


@pytest.mark.parametrize(
    ("header", "buffer", "message"),
    [
        (_two_tensors([0, 8], [4, 8]), 12, "overlap the previous tensor"),
        (_two_tensors([0, 8], [10, 14]), 14, "gap of 2 bytes"),
        (_two_tensors([0, 8], [8, 12]), 10, r"buffer offset 12 but the buffer holds only 10"),
        (_two_tensors([0, 8], [8, 12]), 15, "3 trailing bytes"),
        (_two_tensors([0, 8], [1000, 1004]), 12, "gap of"),
    ],
)
def test_bad_offsets(tmp_path, header, buffer, message):
    path = _write_raw(tmp_path / "offsets.safetensors", header, bytes(buffer))
    with pytest.raises(ValueError, match=message):
        read_safetensors_header(path)
    with pytest.raises(SafetensorError):  # the reference library rejects the same files
        load_file(path)


def test_good_hand_written_file_loads_in_both_readers(tmp_path):
    data = np.array([1.5, -2.0], np.float32).tobytes() + bytes([1, 2, 3, 4])
    path = _write_raw(tmp_path / "ok.safetensors", _two_tensors([0, 8], [8, 12]), data)
    tensors, metadata = load_safetensors(path)
    assert metadata == {}
    np.testing.assert_array_equal(tensors["a"], [1.5, -2.0])
    np.testing.assert_array_equal(tensors["b"], load_file(path)["b"])


def test_index_reading(tmp_path):
    index = {
        "metadata": {"total_size": 12},
        "weight_map": {"a": "s1.safetensors", "b": "s0.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    got = read_safetensors_index(tmp_path / "model.safetensors.index.json")
    assert got.total_size == 12
    assert dict(got.weight_map) == index["weight_map"]
    assert got.shard_files == (str(tmp_path / "s0.safetensors"), str(tmp_path / "s1.safetensors"))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not a valid JSON index"),
        ('{"weight_map": []}', "weight_map"),
        ('{"weight_map": {"a": "../x.safetensors"}}', "expected a file name"),
        ('{"weight_map": {"a": "x"}, "metadata": {"total_size": -1}}', "total_size"),
    ],
)
def test_bad_index(tmp_path, text, message):
    path = tmp_path / "model.safetensors.index.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_safetensors_index(path)


def test_a_header_nested_too_deeply_is_a_value_error(tmp_path):
    path = tmp_path / "nested.safetensors"
    header = b"[" * 200_000
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="nested too deeply"):
        read_safetensors_header(path)


def test_an_82_mib_header_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "huge.safetensors"
    n = 82 * 2**20
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n))
        f.truncate(8 + n)  # sparse: 82 MiB of header that no real checkpoint has
    with pytest.raises(ValueError, match="exceeds the 16777216-byte limit"):
        read_safetensors_header(path)


def test_read_tensor_bytes_gives_the_stored_bytes_in_chunks(tmp_path):
    data = np.arange(3000, dtype=np.uint16)
    save_file({"x": data}, str(tmp_path / "m.safetensors"))
    header = read_safetensors_header(tmp_path / "m.safetensors")
    chunks = list(read_tensor_bytes(header, "x", chunk_bytes=1024))
    assert [c.size for c in chunks] == [1024] * 5 + [880]  # 6000 bytes
    assert np.concatenate(chunks).tobytes() == data.tobytes()
