"""nvme.format: the safetensors layout, both ways with the safetensors library."""

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nvme import IOEngine, aligned_empty
from nvme.format import (DATA_ALIGN_BYTES, DTYPE_FROM_NAME, FormatError, SafetensorsFile,
                         header_bytes, names_by_file, read_header, write_file)


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, dtype) in enumerate(DTYPE_FROM_NAME.items()):
        numel = [1, 7, 1001, 4099, 33][i % 5]
        raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                            dtype=torch.uint8, generator=gen)
        t = (raw % 2 if dtype == torch.bool else raw).view(dtype)
        out[f"layer.{i}.{name.lower()}"] = t.reshape(numel, 1) if i % 2 else t
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.empty(0, 4)
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("use_engine", [False, True])
def test_our_files_load_with_the_safetensors_library(tmp_path, use_engine):
    tensors = sample_tensors()
    path = tmp_path / "ours.safetensors"
    with IOEngine(threads=2, block_bytes=8192) as eng:
        size = write_file(path, tensors, {"step": "7"}, engine=eng if use_engine else None)
    assert size == os.path.getsize(path)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, t in tensors.items():
        assert same_bytes(loaded[name], t), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"step": "7"}
        name = "layer.4.i64"
        assert same_bytes(f.get_tensor(name), tensors[name])
    infos, meta = read_header(path)
    first = min(i.offset for i in infos.values())
    assert first % DATA_ALIGN_BYTES == 0 and meta == {"step": "7"}
    (hlen,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert (8 + hlen) % DATA_ALIGN_BYTES == 0


@pytest.mark.parametrize("use_engine", [False, True])
def test_read_hugging_face_shards_tensor_by_tensor(tmp_path, use_engine):
    tensors = sample_tensors(1)
    path = tmp_path / "hf.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    with IOEngine(threads=2, block_bytes=8192) as eng, SafetensorsFile(path) as f:
        engine = eng if use_engine else None
        assert f.metadata == {"format": "pt"}
        total = 0
        for name in names_by_file(f.tensors.values()):
            info = f.info(name)
            out = aligned_empty(info.shape, info.dtype)
            f.read_into(name, out, engine)
            assert same_bytes(out, tensors[name]), name
            total += info.nbytes
            assert f.bytes_read == total  # only this tensor's bytes were read
        assert same_bytes(f.read("layer.3.bf16", engine), tensors["layer.3.bf16"])
        h = f.submit_read("layer.1.f32", torch.empty(7, 1), eng, checksum=True)
        assert h.wait().crc32 is not None
        with pytest.raises(KeyError, match="no tensor named"):
            f.info("nope")
        with pytest.raises(ValueError, match="bytes"):
            f.read_into("layer.1.f32", torch.empty(8))


def test_header_bytes_padding_and_metadata_width(tmp_path):
    t = {"x": torch.zeros(3)}
    for meta in (None, {"a": "b"}, {"crc32": "0" * 8}):
        h = header_bytes(t, meta)
        assert len(h) % DATA_ALIGN_BYTES == 0
        (n,) = struct.unpack("<Q", h[:8])
        assert json.loads(h[8:8 + n])["x"]["data_offsets"] == [0, 12]
    assert len(header_bytes(t, {"crc32": "00000000"})) == len(header_bytes(t, {"crc32": "ffffffff"}))


def write_raw(path, header: dict | bytes, data: bytes = b"", length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize("header,data,match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "past the end"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlap"),
    ({"a": {"dtype": "Q7", "shape": [1], "data_offsets": [0, 1]}}, b"\0", "unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12 bytes"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
    (b"{not json", b"", "not valid JSON"),
    ({"__metadata__": {"k": 1}}, b"", "__metadata__"),
])
def test_malformed_headers_are_rejected_with_the_path(tmp_path, header, data, match):
    path = write_raw(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(FormatError, match=match) as ei:
        read_header(path)
    assert str(path) in str(ei.value)


def test_impossible_header_length_and_short_files(tmp_path):
    with pytest.raises(FormatError, match="impossible"):
        read_header(write_raw(tmp_path / "a", b"{}", length=1 << 40))
    (tmp_path / "b").write_bytes(b"\1\2")
    with pytest.raises(FormatError, match="too short"):
        read_header(tmp_path / "b")
    with pytest.raises(FormatError, match="cannot open"):
        read_header(tmp_path / "missing")
    with pytest.raises(FormatError, match="too short"):
        SafetensorsFile(tmp_path / "b")  # and its __del__ has nothing to close


def test_truncated_tensor_data_is_an_error_on_read(tmp_path):
    path = tmp_path / "t.safetensors"
    write_file(path, {"a": torch.arange(10_000, dtype=torch.float32)})
    f = SafetensorsFile(path)
    os.truncate(path, os.path.getsize(path) - 100)  # the header was already checked
    with pytest.raises(FormatError, match="truncated"):
        f.read("a")
    with IOEngine(threads=1) as eng, pytest.raises(OSError, match="end of file"):
        f.read("a", eng)
    f.close()


def test_non_atomic_write_and_unsupported_dtype(tmp_path):
    write_file(tmp_path / "n.safetensors", {"a": torch.ones(2, 3).t()}, atomic=False)
    assert torch.equal(load_file(tmp_path / "n.safetensors")["a"], torch.ones(3, 2))
    with pytest.raises(FormatError, match="no safetensors name"):
        write_file(tmp_path / "c.safetensors", {"c": torch.ones(2, dtype=torch.complex64)})
    assert not os.path.exists(tmp_path / "c.safetensors")


def test_tensor_checksums_are_verified_on_read_with_either_crc(tmp_path, monkeypatch):
    """write_file(checksums=True) records each tensor's CRC in the metadata (CRC-32C, or zlib's
    CRC-32 where the crc32c package is missing: the GPU machine); every whole-tensor read checks
    it; a damaged byte is refused; a CRC-32C file where the package is missing says to install it."""
    import nvme.format as fmt
    for kind in ("crc32c", "crc32"):
        monkeypatch.setattr(fmt, "WRITE_CHECKSUM", kind)
        path = tmp_path / f"{kind}.safetensors"
        values = {"a": torch.arange(4096, dtype=torch.float32), "b": torch.ones(3, dtype=torch.bfloat16)}
        fmt.write_file(path, values, {"format": "pt"}, checksums=True)
        infos, meta = fmt.read_header(path)
        assert set(meta) == {"format", fmt.CHECKSUM_KEYS[kind]}
        with fmt.SafetensorsFile(path) as f:
            assert f.checksum_kind == kind and torch.equal(f.read("a"), values["a"])
        with open(path, "r+b") as f:
            f.seek(infos["a"].offset + 1000)
            f.write(b"\x7f")
        with fmt.SafetensorsFile(path) as f, pytest.raises(fmt.FormatError, match="'a' fails its checksum"):
            f.read("a")
    monkeypatch.setattr(fmt, "_crc_func", lambda kind: None if kind == "crc32c" else __import__("zlib").crc32)
    with pytest.raises(fmt.FormatError, match="pip install crc32c"):
        fmt.SafetensorsFile(tmp_path / "crc32c.safetensors")
