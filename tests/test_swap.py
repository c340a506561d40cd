"""nvme.swap: the swap store (ordering, manifest, checksums, crashes, disk full, locking)."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from nvme import ChecksumError, IOEngine, SwapError, SwapStore, aligned_empty
from nvme.format import DTYPE_FROM_NAME, tensor_bytes
from nvme.io import CHECKSUM, CRC_FUNCS
from nvme.swap import file_name

crc = CRC_FUNCS[CHECKSUM]

CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def random_tensor(shape, dtype, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    return (raw % 2 if dtype == torch.bool else raw).view(dtype).reshape(shape)


def same_bytes(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture
def engine():
    with IOEngine(threads=4, block_bytes=1 << 16) as eng:
        yield eng


def run_child(code: str, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=CHILD_ENV)


def test_round_trip_every_dtype_and_reopen(tmp_path, engine):
    shapes = [(1,), (7, 3), (1001,), (4099,), (2, 0)]
    expect = {}
    with SwapStore(tmp_path, engine=engine) as store:
        handles = []
        for i, dtype in enumerate(DTYPE_FROM_NAME.values()):
            name = f"block.{i}/{dtype}".replace("torch.", "")
            expect[name] = random_tensor(shapes[i % len(shapes)], dtype, seed=i)
            handles.append(store.write(name, expect[name]))
        engine.wait_all(handles)
        assert store.names() == sorted(expect)
        store.commit(step=12)
    with SwapStore(tmp_path, engine=engine) as store:
        assert store.step == 12 and store.names() == sorted(expect)
        for name, t in expect.items():
            e = store.info(name)
            assert (e.dtype, e.shape, e.nbytes) == (t.dtype, tuple(t.shape), t.numel() * t.element_size())
            assert e.crc32 == crc(tensor_bytes(t.contiguous()))
            assert e.offset % 4096 == 0
            assert same_bytes(store.read(name), t), name
            out = aligned_empty(t.shape, t.dtype)
            store.read_into(name, out).wait()
            assert same_bytes(out, t)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["step"] == 12 and set(manifest["tensors"]) == set(expect)


def test_swap_files_are_plain_safetensors(tmp_path, engine):
    t = random_tensor((33, 5), torch.bfloat16)
    with SwapStore(tmp_path, engine=engine) as store:
        store.write("opt.exp_avg", t).wait()
        path = tmp_path / store.info("opt.exp_avg").file
        assert same_bytes(load_file(path)["opt.exp_avg"], t)
        with safe_open(str(path), framework="pt") as f:
            assert same_bytes(f.get_tensor("opt.exp_avg"), t)
            assert f.metadata()["crc32"] == f"{crc(tensor_bytes(t)):08x}"
    assert file_name("a/b c") != file_name("a%2Fb c") and "/" not in file_name("../x")
    assert len(file_name("x" * 1000)) < 200 and file_name("x" * 1000) != file_name("x" * 999)


def test_read_after_pending_write_sees_new_data_and_earlier_read_sees_old(tmp_path, engine):
    old = torch.zeros(2 << 20)
    new = torch.arange(2 << 20, dtype=torch.float32)
    newer = -new
    with SwapStore(tmp_path, engine=engine) as store:
        store.write("w", old).wait()
        store.commit()
        before = torch.empty_like(old)
        h_before = store.read_into("w", before)   # submitted before the write: the old data
        h1 = store.write("w", new)
        after = torch.empty_like(new)
        store.read_into("w", after).wait()          # sees the write still in flight
        assert torch.equal(after, new)
        h2 = store.write("w", newer)                # same name again: queued behind h1
        last = store.read("w")
        engine.wait_all([h_before, h1, h2])
        assert torch.equal(before, old)
        assert torch.equal(last, newer)
        assert torch.equal(store.read("w"), newer)
        assert store.info("w").crc32 == crc(tensor_bytes(newer))


def test_read_ahead_and_write_behind_of_many_names(tmp_path, engine):
    tensors = {f"b{i}.{k}": random_tensor((5000 + i,), torch.float32, seed=i * 3 + j)
               for i in range(20) for j, k in enumerate(("p", "m", "v"))}
    with SwapStore(tmp_path, engine=engine, verify="always") as store:
        handles = [store.write(n, t) for n, t in tensors.items()]
        store.flush()
        assert all(h.done() for h in handles)
        outs = {n: torch.empty_like(t) for n, t in tensors.items()}
        engine.wait_all([store.read_into(n, outs[n]) for n in tensors])
        assert all(same_bytes(outs[n], tensors[n]) for n in tensors)
        store.remove("b0.p")
        assert "b0.p" not in store.names() and not (tmp_path / file_name("b0.p")).exists()
        with pytest.raises(KeyError, match="no tensor named 'b0.p'"):
            store.read_into("b0.p", outs["b0.p"])
        with pytest.raises(ValueError, match="bytes"):
            store.read_into("b1.p", torch.empty(3))


def test_flipped_byte_is_detected_and_named(tmp_path, engine):
    t = random_tensor((100_000,), torch.float32)
    with SwapStore(tmp_path, engine=engine) as store:
        store.write("layer.3.exp_avg_sq", t).wait()
        e = store.info("layer.3.exp_avg_sq")
    path = tmp_path / e.file
    with open(path, "r+b") as f:
        f.seek(e.offset + 12_345)
        b = f.read(1)
        f.seek(e.offset + 12_345)
        f.write(bytes([b[0] ^ 0x10]))
    with SwapStore(tmp_path, engine=engine) as store:     # a cold read: verified
        out = torch.empty_like(t)
        with pytest.raises(ChecksumError) as ei:
            store.read_into("layer.3.exp_avg_sq", out).wait()
        msg = str(ei.value)
        assert "'layer.3.exp_avg_sq'" in msg and str(path) in msg and f"offset {e.offset}" in msg
        assert f"{e.crc32:08x}" in msg and "corrupt" in msg
        store.read_into("layer.3.exp_avg_sq", out, verify="never").wait()  # switchable off
        assert (out.view(torch.uint8) != t.view(torch.uint8)).sum() == 1
    with SwapStore(tmp_path, engine=engine, verify="off") as store:
        store.read("layer.3.exp_avg_sq")


def test_missing_file_and_crash_before_commit(tmp_path, engine):
    with SwapStore(tmp_path, engine=engine) as store:
        store.write("a", torch.ones(10)).wait()
        store.write("b", torch.ones(10)).wait()
        store.commit(step=1)
    os.unlink(tmp_path / file_name("a"))
    # a process that wrote new data and died before commit(): the files win, the step does not
    r = run_child("""
        import os, sys, torch
        from nvme import SwapStore
        s = SwapStore(sys.argv[1])
        s.write("b", torch.full((10,), 2.0)).wait()
        s.write("c", torch.full((3,), 3.0)).wait()
        s.set_step(2)
        os._exit(0)
    """, tmp_path)
    assert r.returncode == 0, r.stderr
    with SwapStore(tmp_path, engine=engine) as store:
        assert store.step == 1 and store.names() == ["a", "b", "c"]
        assert torch.equal(store.read("b"), torch.full((10,), 2.0))
        assert torch.equal(store.read("c"), torch.full((3,), 3.0))
        with pytest.raises(SwapError, match="missing"):
            store.read("a")
        store.write("a", torch.zeros(4)).wait()  # rewriting repairs it
        assert torch.equal(store.read("a"), torch.zeros(4))


def test_sigkill_mid_write_leaves_old_data_intact(tmp_path):
    r = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, torch
        from nvme import SwapStore
        s = SwapStore(sys.argv[1])
        s.write("x", torch.full((4 << 20,), 0.0)).wait()
        s.commit(0)
        print("ready", flush=True)
        k = 1
        while True:
            s.write("x", torch.full((4 << 20,), float(k))).wait()
            k += 1
    """), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=CHILD_ENV)
    try:
        assert r.stdout.readline().strip() == "ready"
        tmp = tmp_path / (file_name("x") + ".tmp")
        deadline = time.time() + 30
        while not (tmp.exists() and tmp.stat().st_size > 0) and time.time() < deadline:
            time.sleep(0.0005)
        assert tmp.exists(), "the writer never got caught mid-write"
        r.send_signal(signal.SIGKILL)
    finally:
        r.kill()
        r.wait()
        r.stdout.close()
    with SwapStore(tmp_path) as store:     # the lock died with the process
        assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
        x = store.read("x")                 # cold read: checksum verified
        assert x.shape == (4 << 20,) and bool((x == x[0]).all()) and float(x[0]).is_integer()


STORE_FSIZE_CHILD = """
    import json, os, resource, signal, sys, torch
    from nvme import SwapStore, SwapError
    d = sys.argv[1]
    out = {}
    s = SwapStore(d)
    old = torch.arange(1000, dtype=torch.int32)
    s.write("x", old).wait()
    s.commit(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    for name in ("x", "y"):
        try:
            s.write(name, torch.ones(1 << 20, dtype=torch.int32)).wait()
        except SwapError as e:
            out[name] = [e.errno, str(e)]
    out["names"] = s.names()
    out["x_intact"] = bool(torch.equal(s.read("x"), old)) and s.info("x").nbytes == 4000
    out["tmp_left"] = [f for f in os.listdir(d) if f.endswith(".tmp")]
    try:
        s.flush()
    except SwapError as e:
        out["flush"] = str(e)
    s.close()
    print(json.dumps(out))
"""


def test_file_size_limit_gives_clean_error_and_keeps_old_data(tmp_path):
    r = run_child(STORE_FSIZE_CHILD, tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    code, msg = out["x"]
    assert code == errno.EFBIG and "File too large" in msg and "offset" in msg
    assert str(tmp_path / file_name("x")) in msg and "previous version" in msg
    assert out["y"][0] == errno.EFBIG
    assert out["names"] == ["x"] and out["x_intact"] and out["tmp_left"] == []
    assert "File too large" in out["flush"]
    with SwapStore(tmp_path) as store:
        assert store.step == 1 and store.names() == ["x"]
        assert torch.equal(store.read("x"), torch.arange(1000, dtype=torch.int32))


@pytest.fixture
def small_tmpfs(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(d)], capture_output=True)
    if r.returncode:
        pytest.skip(f"cannot mount a small tmpfs: {r.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def test_disk_full_preflight_and_mid_write(small_tmpfs, engine, monkeypatch):
    with SwapStore(small_tmpfs, engine=engine) as store:
        old = torch.arange(100_000, dtype=torch.int32)   # 400 KB of 2 MiB
        store.write("x", old).wait()
        with pytest.raises(SwapError) as ei:
            store.preflight(10 << 20)
        assert ei.value.errno == errno.ENOSPC
        assert "needs 10485760 bytes (10.0 MiB)" in str(ei.value) and "are free" in str(ei.value)
        assert store.preflight(100_000) > 100_000
        with pytest.raises(SwapError, match="needs .* but only .* free"):
            store.write("x", torch.ones(1 << 20, dtype=torch.int32))   # 4 MiB: refused up front
        # space taken behind the store's back after its check: the write itself hits ENOSPC
        filler = small_tmpfs / "filler"
        free = store.free_bytes()
        big = torch.ones(250_000, dtype=torch.int32)                     # 1 MB
        filler.write_bytes(b"\0" * (free - 600_000))
        monkeypatch.setattr(store, "free_bytes", lambda: 1 << 40)        # the check is fooled
        with pytest.raises(SwapError) as ei:
            store.write("x", big).wait()
        assert ei.value.errno == errno.ENOSPC and "No space left on device" in str(ei.value)
        assert torch.equal(store.read("x"), old) and store.names() == ["x"]
        assert not [f for f in os.listdir(small_tmpfs) if f.endswith(".tmp")]
        with pytest.raises(SwapError, match="No space left"):
            store.flush()
        filler.unlink()
        store.write("x", big).wait()
        assert torch.equal(store.read("x"), big)


def test_second_opener_gets_a_clear_error(tmp_path, engine):
    store = SwapStore(tmp_path, engine=engine)
    with pytest.raises(SwapError, match="locked by another SwapStore in this process"):
        SwapStore(tmp_path, engine=engine)
    r = run_child("""
        import sys
        from nvme import SwapStore, SwapError
        try:
            SwapStore(sys.argv[1])
        except SwapError as e:
            print(e)
    """, tmp_path)
    assert f"locked by another SwapStore in process {os.getpid()}" in r.stdout, r.stderr
    store.close()
    with pytest.raises(SwapError, match="closed"):
        store.write("a", torch.ones(1))
    SwapStore(tmp_path, engine=engine).close()   # free again


def test_threads_writing_and_reading_the_same_names(tmp_path, engine):
    errors = []
    with SwapStore(tmp_path, engine=engine, verify="always") as store:
        def worker(k):
            try:
                for i in range(15):
                    value = torch.full((20_000,), float(k * 100 + i))
                    h = store.write(f"own{k}", value)
                    store.write("shared", value).wait()
                    assert torch.equal(store.read(f"own{k}"), value)  # pending or on disk: new
                    h.wait()
                    shared = store.read("shared")
                    assert bool((shared == shared[0]).all())           # never a torn mix
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert store.names() == ["own0", "own1", "own2", "own3", "shared"]
