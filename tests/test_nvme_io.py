"""nvme.io: the async IO engine (O_DIRECT + buffered fallback, splitting, errors, checksums)."""

import errno
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import zlib

import pytest
import torch

pytest.importorskip("hypothesis", reason="property tests need hypothesis: pip install -e '.[test]' "
                    "(the GPU machine has none; its kit is `pytest -m cuda`)")

from hypothesis import given, settings, strategies as st

import nvme.io
from nvme import ALIGN, IOEngine, IOEngineError, IOHandle, aligned_empty, crc32_combine
from nvme.io import CHECKSUM, CRC_FUNCS, crc_combine

crc = CRC_FUNCS[CHECKSUM]  # what checksum=True computes (CRC-32C where the crc32c package is)
from nvme.format import DTYPE_FROM_NAME, tensor_bytes
from nvme.io import _BOUNCE, _BUFFERED, _DIRECT

ODD_NUMELS = [1, 3, 1021, 4099, 12_345]


def random_tensor(numel: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


@pytest.fixture
def engine():
    # Small blocks so that small test files still split into many direct/bounce/buffered tasks.
    with IOEngine(threads=4, block_bytes=2 * ALIGN, queue_depth=8) as eng:
        yield eng


@pytest.fixture
def mounted(tmp_path):
    """mount(fstype, size) -> a fresh mount point, unmounted afterwards; skips if not permitted."""
    points = []

    def mount(fstype: str, size: str | None = None):
        d = tmp_path / f"mnt{len(points)}"
        d.mkdir()
        opts = ["-o", f"size={size}"] if size else []
        r = subprocess.run(["mount", "-t", fstype, *opts, fstype, str(d)], capture_output=True)
        if r.returncode:
            pytest.skip(f"cannot mount {fstype}: {r.stderr.decode().strip()}")
        points.append(d)
        return d
    yield mount
    for d in points:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000), st.integers(0, 2**32 - 1))
def test_crc32_combine_matches_zlib(a, b, seed):
    assert crc32_combine(zlib.crc32(a, seed), zlib.crc32(b), len(b)) == zlib.crc32(b, zlib.crc32(a, seed))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000), st.integers(0, 2**32 - 1))
def test_crc_combine_for_every_kind(a, b, seed):
    for name, fn in CRC_FUNCS.items():
        assert crc_combine(fn(a, seed), fn(b), len(b), name) == fn(b, fn(a, seed)), name


def test_checksum_is_crc32c_and_both_kinds_can_be_asked_for(tmp_path):
    assert CHECKSUM == "crc32c"  # the declared dependency is installed
    t = torch.arange(50_000, dtype=torch.int32)
    with IOEngine(threads=2, block_bytes=2 * ALIGN) as eng:
        eng.submit_write(tmp_path / "f", 0, t).wait()
        for name, fn in CRC_FUNCS.items():
            out = torch.empty_like(t)
            h = eng.submit_read(tmp_path / "f", 0, out, checksum=name).wait()
            assert (h.checksum, h.crc32) == (name, fn(tensor_bytes(t)))


def test_crc32_combine_long_lengths():
    a, b = os.urandom(100), bytes(5_000_000) + os.urandom(7)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@pytest.mark.parametrize("direct", ["auto", False])
def test_round_trip_every_dtype_odd_sizes_and_offsets(tmp_path, direct):
    gen = torch.Generator().manual_seed(0)
    with IOEngine(threads=3, block_bytes=2 * ALIGN, direct=direct) as eng:
        path = tmp_path / "f.bin"
        for dtype in DTYPE_FROM_NAME.values():
            for numel in ODD_NUMELS:
                for offset in (0, 1, ALIGN - 3, 3 * ALIGN):
                    src = random_tensor(numel, dtype, gen)
                    h = eng.submit_write(path, offset, src, checksum=True)
                    assert h.wait() is h and h.done()
                    assert h.crc32 == crc(tensor_bytes(src))
                    out = torch.empty_like(src)
                    h = eng.submit_read(path, offset, out, checksum=True).wait()
                    assert torch.equal(out.view(torch.uint8), src.view(torch.uint8)), (dtype, numel, offset)
                    assert h.crc32 == crc(tensor_bytes(src))
        assert eng.direct_supported(tmp_path) == (direct == "auto")


def test_plan_uses_direct_bounce_and_buffered_pieces(engine):
    aligned = aligned_empty(10 * ALIGN).data_ptr()
    kinds = lambda plan: [k for *_, k in plan]  # noqa: E731
    assert kinds(engine._plan(0, 6 * ALIGN, aligned, True)) == [_DIRECT] * 3
    assert kinds(engine._plan(0, 6 * ALIGN, aligned + 8, True)) == [_BOUNCE] * 3
    head_body_tail = engine._plan(100, 4 * ALIGN, aligned + 100, True)
    assert kinds(head_body_tail) == [_BUFFERED, _DIRECT, _DIRECT, _BUFFERED]
    assert sum(n for _, _, n, _ in head_body_tail) == 4 * ALIGN
    assert kinds(engine._plan(10, 100, aligned, True)) == [_BUFFERED]
    assert kinds(engine._plan(0, 6 * ALIGN, aligned, False)) == [_BUFFERED] * 3


@pytest.mark.parametrize("mem_shift", [0, 1, 8, 100])
def test_direct_and_bounce_round_trip_with_unaligned_memory(tmp_path, engine, mem_shift, monkeypatch):
    monkeypatch.setattr(nvme.io, "BOUNCE_BYTES", ALIGN)  # bounce blocks go in several chunks
    gen = torch.Generator().manual_seed(mem_shift)
    base = aligned_empty(9 * ALIGN + 200)
    src = base[mem_shift:mem_shift + 9 * ALIGN + 77]
    src.copy_(random_tensor(src.numel(), torch.uint8, gen))
    for offset in (0, ALIGN, 37):
        engine.submit_write(tmp_path / "f", offset, src).wait()
        out = aligned_empty(9 * ALIGN + 300)[mem_shift + 5:mem_shift + 5 + src.numel()]
        engine.submit_read(tmp_path / "f", offset, out).wait()
        assert torch.equal(out, src)


def test_many_concurrent_requests(tmp_path):
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    path = tmp_path / "many.bin"
    spans, offset = [], 0
    for _ in range(300):
        offset += rng.randrange(0, 3 * ALIGN)
        n = rng.randrange(1, 40_000)
        spans.append((offset, random_tensor(n, torch.uint8, gen)))
        offset += n
    with IOEngine(threads=6, block_bytes=4 * ALIGN, queue_depth=4) as eng:
        IOEngine.wait_all([eng.submit_write(path, o, t) for o, t in spans])
        outs = [torch.empty_like(t) for _, t in spans]
        handles = [eng.submit_read(path, o, out, checksum=True) for (o, _), out in zip(spans, outs)]
        eng.wait_all(handles)
        for (o, t), out, h in zip(spans, outs, handles):
            assert torch.equal(out, t), o
            assert h.crc32 == crc(tensor_bytes(t))
        assert eng.bytes_written == eng.bytes_read == sum(t.numel() for _, t in spans)


def test_submissions_from_many_threads(tmp_path, engine):
    errors = []

    def worker(k):
        try:
            src = torch.full((30_000,), k, dtype=torch.uint8)
            engine.submit_write(tmp_path / f"t{k}", 0, src).wait()
            out = torch.empty_like(src)
            engine.submit_read(tmp_path / f"t{k}", 0, out).wait()
            assert torch.equal(out, src)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_zero_length_and_buffers_other_than_tensors(tmp_path, engine):
    assert engine.submit_write(tmp_path / "z", 0, torch.empty(0)).wait().done()
    assert os.path.getsize(tmp_path / "z") == 0
    engine.submit_write(tmp_path / "b", 5, b"hello world" * 1000).wait()
    out = bytearray(11_000)
    engine.submit_read(tmp_path / "b", 5, out).wait()
    assert bytes(out) == b"hello world" * 1000
    with pytest.raises(ValueError, match="writable"):
        engine.submit_read(tmp_path / "b", 0, b"readonly")
    with pytest.raises(ValueError, match="contiguous"):
        engine.submit_read(tmp_path / "b", 0, torch.empty(4, 4).t())


def test_errors_name_path_offset_length_and_os_error(tmp_path, engine):
    missing = tmp_path / "missing.bin"
    with pytest.raises(IOEngineError) as ei:
        engine.submit_read(missing, 128, torch.empty(10))
    e = ei.value
    assert e.errno == errno.ENOENT and e.path == str(missing) and (e.offset, e.length) == (128, 40)
    assert str(missing) in str(e) and "ENOENT" in str(e) and "offset 128" in str(e)

    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 10_000)
    h = engine.submit_read(short, 0, aligned_empty(5 * ALIGN))
    with pytest.raises(IOEngineError, match="end of file: the file is 10000 bytes") as ei:
        h.wait()
    assert str(short) in str(ei.value) and "20480-byte read at offset 0" in str(ei.value)
    assert isinstance(h.error, IOEngineError) and h.done()
    # wait_all waits for everything, then raises the first failure
    ok = engine.submit_read(short, 0, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(IOEngineError):
        engine.wait_all([engine.submit_read(short, 9_000, torch.empty(5000, dtype=torch.uint8)), ok])
    assert ok.done() and ok.error is None


def test_callbacks_deferred_start_and_close(tmp_path):
    eng = IOEngine(threads=2)
    seen = []
    h = eng.submit_write(tmp_path / "f", 0, torch.ones(100), on_done=lambda h: seen.append(h.error))
    h.wait()
    assert seen == [None]

    def veto(h):
        raise RuntimeError("callback says no")
    with pytest.raises(RuntimeError, match="callback says no"):
        eng.submit_read(tmp_path / "f", 0, torch.empty(100), on_done=veto).wait()
    deferred = eng.submit_read(tmp_path / "f", 0, torch.empty(100), start=False)
    assert not deferred.done()
    assert eng.start(deferred).wait().done()
    with pytest.raises(RuntimeError, match="already started"):
        eng.start(deferred)
    assert IOHandle.finished("read", "x", 0, 0).wait().done()
    eng.close()
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit_read(tmp_path / "f", 0, torch.empty(100))
    with pytest.raises(ValueError):
        IOEngine(block_bytes=1000)


def test_aligned_empty_is_page_aligned():
    for dtype in (torch.uint8, torch.float32, torch.bfloat16, torch.float64):
        for n in (0, 1, 1000, 1 << 20):
            t = aligned_empty(n, dtype)
            assert t.data_ptr() % ALIGN == 0 and t.numel() == n and t.dtype == dtype
    assert aligned_empty((3, 5), torch.int16).shape == (3, 5)
    assert aligned_empty(100, pin=True).data_ptr() % ALIGN == 0  # plain memory without CUDA


def test_buffered_fallback_where_o_direct_is_rejected(tmp_path, mounted):
    ramfs = mounted("ramfs")  # ramfs refuses O_DIRECT (tmpfs accepts it on recent kernels)
    src = torch.arange(50_000, dtype=torch.int32)
    with IOEngine(threads=2, block_bytes=4 * ALIGN) as eng:
        assert not eng.direct_supported(ramfs)
        eng.submit_write(ramfs / "f", 3, src).wait()
        out = torch.empty_like(src)
        eng.submit_read(ramfs / "f", 3, out).wait()
        assert torch.equal(out, src)
    with IOEngine(threads=1, direct=True) as eng:
        with pytest.raises(IOEngineError, match="O_DIRECT is not supported"):
            eng.submit_write(ramfs / "g", 0, aligned_empty(ALIGN))


def test_tmpfs_round_trip_and_disk_full(mounted):
    small = mounted("tmpfs", "1m")
    with IOEngine(threads=2, block_bytes=4 * ALIGN) as eng:
        src = torch.arange(100_000, dtype=torch.int16)
        eng.submit_write(small / "ok", 0, src).wait()
        out = torch.empty_like(src)
        eng.submit_read(small / "ok", 0, out).wait()
        assert torch.equal(out, src)
        with pytest.raises(IOEngineError) as ei:
            eng.submit_write(small / "big", 0, aligned_empty(2 << 20)).wait()
        assert ei.value.errno == errno.ENOSPC and str(small / "big") in str(ei.value)
        assert "No space left on device" in str(ei.value)


CHILD = textwrap.dedent("""
    import errno, json, os, resource, signal, sys, torch
    from nvme import IOEngine, IOEngineError, aligned_empty
    d = sys.argv[1]
    out = {}
    with IOEngine(threads=2, block_bytes=1 << 16) as eng:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
        try:
            eng.submit_write(os.path.join(d, "big"), 0, aligned_empty(3 << 20)).wait()
        except IOEngineError as e:
            out["fsize"] = [e.errno, str(e), e.offset, e.length]
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        if os.geteuid() == 0:
            os.setgid(65534); os.setuid(65534)
        try:
            eng.submit_write(os.path.join(d, "rootfile"), 0, torch.ones(10))
        except IOEngineError as e:
            out["perm"] = [e.errno, str(e)]
    print(json.dumps(out))
""")


def test_file_too_large_and_permission_denied_in_a_child():
    # Outside pytest's tmp_path (mode 0700) so that the unprivileged child can reach the
    # directory and is refused by the file's own mode.
    d = pathlib.Path(tempfile.mkdtemp(prefix="nvme-io-test-"))
    try:
        d.chmod(0o777)
        (d / "rootfile").write_bytes(b"old")
        (d / "rootfile").chmod(0o444)
        r = subprocess.run([sys.executable, "-c", CHILD, str(d)], capture_output=True,
                           text=True, timeout=120)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    code, msg, offset, length = out["fsize"]
    assert code == errno.EFBIG and "File too large" in msg and str(d / "big") in msg
    assert offset >= 0 and length > 0 and f"offset {offset}" in msg
    code, msg = out["perm"]
    assert code == errno.EACCES and "Permission denied" in msg and str(d / "rootfile") in msg
