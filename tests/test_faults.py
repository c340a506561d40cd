"""Disk full and IO errors, injected at the OS-call level while a real NVMe-offloaded fine-tuning
run writes its swap files, its checkpoints and its final export: the run stops with one clear
line, the last good checkpoint stays intact, and resuming from it gives exactly the result of a
run that never failed. Also: memory budgets refused before allocation, the pinned-memory cap."""

from __future__ import annotations

import errno
import gc
import os
import sys
import threading

import pytest
import torch

from offload.train.checkpoint import find_checkpoint, load_trainer_state
from runners.finetune import main

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "scripts"))
import chaos  # noqa: E402  (compare_runs: the same bit-for-bit comparison the campaign uses)

ARGS = ["--offload", "nvme", "--steps", "6", "--save-every", "2", "--batch-size", "8",
        "--seq-len", "16", "--eval-every", "0", "--warmup-steps", "2", "--no-progress"]


class FullDisk:
    """From the (skip+1)-th write call whose file matches `match(path)` on, every such write
    fails with `err` (a disk that filled up stays full) — until heal(). Wraps os.write,
    os.pwrite and os.pwritev, the calls every byte of swap, checkpoint and export data goes
    through; the file behind a descriptor is found in /proc/self/fd."""

    def __init__(self, match, skip: int = 0, err: int = errno.ENOSPC):
        self.match, self.skip, self.err = match, skip, err
        self.seen = 0
        self.failed: list[str] = []
        self.healed = False
        self._lock = threading.Lock()

    def _check(self, fd: int) -> None:
        if self.healed:
            return
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if not self.match(path):
            return
        with self._lock:
            self.seen += 1
            if self.seen <= self.skip:
                return
            self.failed.append(path)
        raise OSError(self.err, os.strerror(self.err))

    def install(self, monkeypatch) -> "FullDisk":
        for name in ("write", "pwrite", "pwritev"):
            real = getattr(os, name)

            def fake(fd, *a, _real=real, **k):
                self._check(fd)
                return _real(fd, *a, **k)
            monkeypatch.setattr(os, name, fake)
        return self

    def heal(self) -> None:
        self.healed = True


def under(root: str, sub: str):
    prefix = os.path.join(os.path.realpath(root), sub)
    return lambda path: path.startswith(prefix)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("faults") / "reference")
    assert main(ARGS + ["--output", out]) == 0
    return out


def _fails_cleanly(capsys, args, *needles) -> str:
    rc = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert err and err[-1].startswith("error: "), err
    assert not any("Traceback" in line for line in err)
    for needle in needles:
        assert needle in err[-1], err[-1]
    _as_if_the_process_exited()
    return err[-1]


def _as_if_the_process_exited() -> None:
    """A failed run exits, and the kernel drops its flock on the swap directory. In-process the
    failed run's SwapStore lingers (runners.finetune does not close the engine when training
    raises), so drop its lock the way exit would: close the descriptor, nothing else."""
    from nvme.swap import SwapStore

    gc.collect()
    for obj in gc.get_objects():
        if type(obj) is SwapStore and obj._lock_fd >= 0:
            os.close(obj._lock_fd)
            obj._lock_fd = -1
            obj._closed = True


def _resume_matches(out: str, reference: str) -> None:
    assert main(ARGS + ["--output", out, "--resume", out]) == 0
    assert chaos.compare_runs(reference, out) == []


def _checkpoint_step(out: str) -> int:
    ckpt = find_checkpoint(out)
    assert ckpt == os.path.join(out, "checkpoint")
    assert not os.path.exists(ckpt + ".tmp"), "the failed save's partial copy was left behind"
    return load_trainer_state(ckpt)["step"]


def test_disk_full_during_a_swap_write(tmp_path, monkeypatch, capsys, reference):
    out = str(tmp_path / "run")
    swap, ckpt = under(out, "swap/"), os.path.join(out, "checkpoint")
    # the disk fills up a little after the checkpoint of update 2, in the middle of an update
    disk = FullDisk(lambda p: swap(p) and os.path.isdir(ckpt), skip=25).install(monkeypatch)
    line = _fails_cleanly(capsys, ARGS + ["--output", out], "No space left on device",
                          "swap write of")
    assert "the store still holds the previous version" in line
    # closing then failed too (the manifest write hits the same full disk): the first error is
    # the one shown, and no temporary file is left behind
    assert not [f for f in os.listdir(os.path.join(out, "swap")) if f.endswith(".tmp")]
    disk.heal()
    assert _checkpoint_step(out) == 2
    _resume_matches(out, reference)


@pytest.mark.parametrize("skip", [0, 7])
def test_disk_full_during_a_checkpoint_save(tmp_path, monkeypatch, capsys, reference, skip):
    out = str(tmp_path / "run")
    ckpt = os.path.join(out, "checkpoint")

    def second_save(path):  # the save of update 4, while the one of update 2 exists
        return path.startswith(os.path.realpath(ckpt) + ".tmp") and os.path.isdir(ckpt)
    disk = FullDisk(second_save, skip=skip).install(monkeypatch)
    _fails_cleanly(capsys, ARGS + ["--output", out], "No space left on device",
                   "saving the checkpoint to", "is intact")
    assert disk.failed
    disk.heal()
    assert _checkpoint_step(out) == 2
    _resume_matches(out, reference)


def test_disk_full_writing_trainer_state(tmp_path, monkeypatch, capsys):
    """The last file of a save (written through a Python file object, not os.write)."""
    import offload.train.checkpoint as ckpt_mod

    out = str(tmp_path / "run")
    real = ckpt_mod.write_json_atomic
    calls = []

    def full(path, obj):
        calls.append(path)
        if len(calls) == 2:  # the second save
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real(path, obj)
    monkeypatch.setattr(ckpt_mod, "write_json_atomic", full)
    _fails_cleanly(capsys, ARGS + ["--output", out], "saving the checkpoint", "trainer_state.json",
                   "is intact")
    assert _checkpoint_step(out) == 2


def test_disk_full_during_the_final_export(tmp_path, monkeypatch, capsys, reference):
    out = str(tmp_path / "run")
    disk = FullDisk(under(out, "model/")).install(monkeypatch)
    _fails_cleanly(capsys, ARGS + ["--output", out], "No space left on device")
    disk.heal()
    assert _checkpoint_step(out) == 6  # the final checkpoint was complete before the export
    assert not [f for f in os.listdir(os.path.join(out, "model")) if "partial" in f or ".tmp" in f]
    _resume_matches(out, reference)  # the resume re-exports


def test_io_error_reading_swap_state(tmp_path, monkeypatch, capsys):
    """EIO from the disk while optimizer state is read back: one line naming the file."""
    out = str(tmp_path / "run")
    swap = os.path.join(os.path.realpath(out), "swap")
    real = os.preadv
    count = [0]

    def failing(fd, *a, **k):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if path.startswith(swap):
            count[0] += 1
            if count[0] > 20:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, *a, **k)
    monkeypatch.setattr(os, "preadv", failing)
    line = _fails_cleanly(capsys, ARGS + ["--output", out], "Input/output error")
    assert "swap" in line and ".safetensors" in line


def test_corrupt_swap_file_is_detected_on_the_first_read(tmp_path):
    """A swap file damaged behind the store's back (bit rot, a foreign writer) fails its
    checksum instead of being trained on."""
    from nvme import SwapStore
    from nvme.swap import ChecksumError

    d = tmp_path / "swap"
    with SwapStore(d) as store:
        store.write("w", torch.arange(5000, dtype=torch.float32)).wait()
    path = d / "w.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x40
    path.write_bytes(bytes(raw))
    with SwapStore(d) as store:
        with pytest.raises(ChecksumError, match="checksum mismatch .* the file is corrupt"):
            store.read("w")


def test_failed_save_pretrained_leaves_the_previous_export(tmp_path, monkeypatch):
    from offload.models import build_model, preset, save_pretrained

    cfg = preset("tiny")
    model = build_model(cfg, device="cpu", source=0)
    out = str(tmp_path / "m")
    save_pretrained(model, out)
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    disk = FullDisk(under(out, ""), skip=3).install(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(model, out)
    disk.heal()
    after = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    assert after == before  # no partial shard, no temporary file, old files untouched


# ---- memory pressure -----------------------------------------------------------------------
def test_plan_larger_than_available_ram_is_refused_before_allocating(tmp_path, monkeypatch, capsys):
    """psutil's available memory is what the host tier is checked against (less a reserve):
    a plan that would not fit is refused in one line, and nothing was written or allocated."""
    import offload.memory.tiers as tiers

    class VM:
        available = 600 << 20  # 600 MiB "available": the tiny plan fits, the 1B one does not
        total = 1 << 30
    monkeypatch.setattr(tiers.psutil, "virtual_memory", lambda: VM)
    out = tmp_path / "big"
    _fails_cleanly(capsys, ["--model", "1B", "--offload", "cpu", "--output", str(out),
                            "--no-progress"], "more than the 600.00 MiB free", "in reserve")
    assert not (out / "checkpoint").exists() and not (out / "swap").exists()


def test_headroom_is_kept_when_checking_free_memory():
    from offload.memory.tiers import BudgetError, check_fits, memory_reserve_bytes

    free = 10 << 30
    reserve = memory_reserve_bytes(free)
    assert 0 < reserve < free
    check_fits("host", free - reserve, None, free, "x", "hint")
    with pytest.raises(BudgetError, match="reserve"):
        check_fits("host", free - reserve + 1, None, free, "x", "hint")
    # an explicit budget below what is free is taken as given
    check_fits("host", 5 << 30, 5 << 30, free, "x", "hint")


def test_pinned_memory_is_capped_with_a_pageable_fallback(monkeypatch):
    import offload.memory.tiers as tiers

    class VM:
        available = 1 << 30
        total = 2 << 30
    monkeypatch.setattr(tiers.psutil, "virtual_memory", lambda: VM)
    monkeypatch.setattr(tiers, "_pinned_bytes", 0)
    monkeypatch.setattr(tiers, "_PIN_WARNED", False)
    cap = tiers.pin_limit_bytes()
    assert cap == (1 << 30) // 2
    assert tiers.pin_allowed(cap // 2)
    monkeypatch.setattr(tiers, "_pinned_bytes", cap // 2)
    assert tiers.pin_allowed(cap // 2)
    assert not tiers.pin_allowed(cap // 2 + 1)
    # without CUDA nothing is ever pinned; the buffer is still there and pageable
    monkeypatch.setattr(tiers, "pin_possible", lambda pin: pin)
    calls = []
    real_empty = torch.empty

    def fake_empty(*a, pin_memory=False, **k):
        calls.append(pin_memory)
        return real_empty(*a, **k)
    monkeypatch.setattr(tiers.torch, "empty", fake_empty)
    with pytest.warns(UserWarning, match="pageable"):
        t = tiers.host_empty((cap // 2 + 4096) // 4, torch.float32, pin=True)
    assert calls == [False] and t.numel() == (cap // 2 + 4096) // 4


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 12 MiB filesystem (tmpfs), where the root may mount one; skipped elsewhere: room
    for the tokenized corpus (1.5 MiB in OUTPUT/data) and one checkpoint, not two."""
    import subprocess

    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs",
                                            str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("needs permission to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_really_full_disk(small_tmpfs, capsys, reference):
    """No injection: the output goes to a 12 MiB filesystem. The first checkpoint fits, the
    second save (which needs room for both copies) runs out of space. After the disk is made
    bigger, the run resumes from the intact first checkpoint and ends as if nothing happened."""
    import subprocess

    out = str(small_tmpfs / "run")
    line = _fails_cleanly(capsys, ARGS + ["--output", out])
    # which check trips first depends on write timing: the kernel's ENOSPC during a save or a
    # swap write, or the swap store's own free-space check counting writes in flight — each a
    # one-line error naming the shortfall
    assert ("No space left on device" in line and ("saving the checkpoint" in line or
                                                   "swap write" in line)) or \
        ("swap directory" in line and "are free there" in line), line
    assert _checkpoint_step(out) >= 2
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)
    _resume_matches(out, reference)
