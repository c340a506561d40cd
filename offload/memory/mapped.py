"""Frozen weights read through a memory map of their swap files instead of held in RAM.

When the device *is* the host (no GPU) and the frozen base lives on NVMe, the frozen parameters
outside the layers -- a LoRA base's embeddings and vocabulary head, 2.1 GB in bf16 for an 8B
Llama-3 with its 128K vocabulary -- need not be resident either: an embedding lookup reads only
the rows of the batch's tokens, and the head is read once per forward and once per backward,
a slice of rows at a time (models.llama._FrozenProjectionCPU). So they are written once into
the swap directory (the swap store's own format: one checksummed safetensors file each) and
their parameters become read-only views of a memory map of those files.

Pages of a file mapping that the process has touched count in its resident set until it lets
them go, so a slice that has been multiplied is handed back with madvise(MADV_DONTNEED)
(`release_pages`): the page table entries go, the bytes stay in the kernel's page cache (not
this process's memory) and a later touch maps them again, from the cache or from the disk.
The mapping is read-only (PROT_READ): a write into a frozen weight is a segmentation fault,
never a silent change that a later release would throw away.

On a GPU the device memory is not the host's, and these weights stay resident there (or in
their streamed block); this module is the CPU device's way to keep them off the RSS."""
from __future__ import annotations

import mmap
import os
import threading
import warnings

import torch
from torch import nn

from nvme.swap import SwapStore
from offload.memory.blocks import replace_parameter

PAGE = mmap.PAGESIZE

_lock = threading.Lock()
# every live map: (first address, length in bytes, the mmap object)
_maps: list[tuple[int, int, mmap.mmap]] = []


def _map_file(path: str, offset: int, nbytes: int, dtype: torch.dtype,
              shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor over `nbytes` of `path` from byte `offset` (the tensor's data)."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the descriptor
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; the mapping itself is (see above)
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive while a view lives
    with _lock:
        _maps.append((whole.data_ptr(), len(mm), mm))
    return whole[offset:offset + nbytes].view(dtype).view(shape)


def map_from_store(store: SwapStore, name: str, value: torch.Tensor) -> torch.Tensor:
    """Write `value` (CPU) into `store` under `name`, then return a read-only mapped tensor of
    the same dtype, shape and values; `value` can then be freed."""
    store.write(name, value).wait()
    info = store.info(name)
    return _map_file(os.path.join(store.dir, info.file), info.offset, info.nbytes, value.dtype,
                     tuple(value.shape))


def _find(t: torch.Tensor) -> tuple[int, int, mmap.mmap] | None:
    if t.device.type != "cpu" or not _maps:
        return None
    ptr = t.data_ptr()
    with _lock:
        for entry in _maps:
            if entry[0] <= ptr < entry[0] + entry[1]:
                return entry
    return None


def is_mapped(t: torch.Tensor) -> bool:
    """Whether `t`'s data lies in one of this module's maps."""
    return _find(t) is not None


def release_pages(t: torch.Tensor) -> None:
    """Drop the pages under `t` (a contiguous view of a mapped tensor) from this process's
    resident set. Whole pages only: a page shared with a neighbouring slice is dropped too and
    simply faulted in again if that slice is read later. No-op for an unmapped tensor."""
    entry = _find(t)
    if entry is None:
        return
    base, length, mm = entry
    start = (t.data_ptr() - base) // PAGE * PAGE
    end = min(length, -(-(t.data_ptr() - base + t.numel() * t.element_size()) // PAGE) * PAGE)
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def forget(t: torch.Tensor) -> None:
    """Stop tracking the map under `t` (its owner is closing): the map itself is unmapped when
    the last tensor viewing it is freed."""
    entry = _find(t)
    if entry is not None:
        with _lock:
            _maps[:] = [e for e in _maps if e is not entry]


def maps_frozen_rest(offload_params: str, device: torch.device) -> bool:
    """The rule, for the engine and its plan alike: frozen parameters outside the streamed
    layers are mapped from the swap directory when the device is the host and the layers
    stream from NVMe (else they are resident on the device)."""
    return device.type == "cpu" and offload_params == "nvme"


def map_frozen(model: nn.Module, store: SwapStore, dtype: torch.dtype, skip: set[int],
               source=None) -> list[torch.Tensor]:
    """Every frozen floating-point parameter of `model` not in `skip` (ids) written to `store`
    in `dtype` and replaced by its mapped view, one at a time (a meta one filled by `source`,
    as blocks.move_frozen_and_buffers fills it). A tied parameter is replaced under each of
    its names. Returns the mapped tensors (for `forget` at close)."""
    mapped = []
    for name, p in list(model.named_parameters()):
        if id(p) in skip or p.requires_grad or not p.is_floating_point():
            continue
        if p.device.type == "meta":
            if source is None:
                return mapped  # move_frozen_and_buffers explains a meta frozen parameter
            value = torch.empty(p.shape, dtype=dtype)
            source({name: value})
        else:
            value = p.detach().to("cpu", dtype)
        view = map_from_store(store, f"frozen.{name}", value)
        del value  # its bytes are in the file (and the page cache), not in this process
        param = replace_parameter(model, p, nn.Parameter(view, requires_grad=False))
        skip.add(id(param))
        mapped.append(view)
    return mapped
