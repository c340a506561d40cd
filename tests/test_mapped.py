"""Frozen weights mapped from swap files (offload/memory/mapped.py): the same values, pages handed back
after use, and the frozen projection reading them a slice at a time with the same results."""

from __future__ import annotations

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nvme.swap import SwapStore
from offload.memory import mapped
from offload.models import llama, projections

MiB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.fixture
def store(tmp_path):
    s = SwapStore(tmp_path / "swap")
    yield s
    s.close()


def test_mapped_tensor_has_the_values_and_gives_its_pages_back(store):
    value = torch.randn(4096, 4096).to(torch.bfloat16)  # 32 MiB
    w = mapped.map_from_store(store, "frozen.w", value)
    try:
        assert w.dtype == torch.bfloat16 and w.shape == value.shape and torch.equal(w, value)
        assert mapped.is_mapped(w) and mapped.is_mapped(w[100:200]) and not mapped.is_mapped(value)
        mapped.release_pages(w)
        before = _rss()
        w.float().sum()  # touches every page of the map (the fp32 copy is freed at once)
        touched = _rss()
        mapped.release_pages(w)
        after = _rss()
        assert touched - before > 24 * MiB, (before, touched)
        assert touched - after > 24 * MiB, (touched, after)
        assert torch.equal(w, value)  # released pages come back with the same bytes
    finally:
        mapped.forget(w)
    assert not mapped.is_mapped(w)
    mapped.release_pages(w)  # no longer tracked: a no-op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_projection_over_a_mapped_weight(store, monkeypatch, dtype):
    """Forward and input gradient over a mapped weight equal the resident weight's
    (fp32: the chunked sum over 8192 outputs reassociates, so within 1e-5), and reading it a slice at a
    time keeps the resident set far below the weight's size."""
    monkeypatch.setattr(projections, "FROZEN_GRAD_CHUNK_BYTES", 1 * MiB)
    torch.manual_seed(0)
    value = (torch.randn(8192, 2048) * 0.02).to(dtype)  # 32 or 64 MiB, vocabulary-head shaped
    layer = nn.Linear(2048, 8192, bias=False)
    layer.weight = nn.Parameter(mapped.map_from_store(store, "frozen.head", value), requires_grad=False)
    try:
        x = torch.randn(3, 5, 2048, dtype=dtype, requires_grad=True)
        mapped.release_pages(layer.weight)
        before = _rss()
        y = llama.project(layer, x)
        y.float().pow(2).sum().backward()
        grown = _rss() - before
        x_ref = x.detach().clone().requires_grad_(True)
        y_ref = F.linear(x_ref, value)
        y_ref.float().pow(2).sum().backward()
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(x.grad, x_ref.grad, **tol)
        assert grown < value.numel() * value.element_size() // 4, grown
    finally:
        mapped.forget(layer.weight)


def test_frozen_projection_without_grad_reads_slices_too(store, monkeypatch):
    """Evaluation under no_grad takes the same sliced path (not nn.Linear over the whole map)."""
    monkeypatch.setattr(projections, "FROZEN_GRAD_CHUNK_BYTES", 1 * MiB)
    value = torch.randn(4096, 1024)
    layer = nn.Linear(1024, 4096, bias=True)
    bias = layer.bias.detach().clone()
    layer.weight = nn.Parameter(mapped.map_from_store(store, "frozen.w2", value), requires_grad=False)
    layer.bias.requires_grad_(False)
    try:
        x = torch.randn(2, 1024)
        with torch.no_grad():
            y = llama.project(layer, x)
        torch.testing.assert_close(y, F.linear(x, value, bias), rtol=1e-6, atol=1e-6)
    finally:
        mapped.forget(layer.weight)
