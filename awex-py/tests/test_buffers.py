"""Parameters that are views of one contiguous buffer (Megatron DDP's ``param_data`` under the
distributed optimizer) are one allocation, as the cuda-ipc transport exports them."""

from __future__ import annotations

import pytest

import awex.megatron as am

torch = pytest.importorskip("torch")


def test_views_of_one_buffer_are_one_allocation():
    buf = torch.zeros(64 + 32 + 8)
    named = [("a", buf[:64].view(8, 8)), ("b", buf[64:96].view(4, 8)), ("c", buf[96:])]
    other = torch.ones(5)
    allocs = am.allocations(named + [("d", other)])
    assert len(allocs) == 2
    assert allocs[0]["base"] == buf.data_ptr() and allocs[0]["bytes"] == buf.numel() * 4
    assert allocs[0]["names"] == ["a", "b", "c"]
    assert allocs[1]["names"] == ["d"] and allocs[1]["bytes"] == 20


class _Buf:
    def __init__(self, data):
        self.param_data = data


class _DDP:
    def __init__(self, bufs, expert):
        self.buffers = [_Buf(b) for b in bufs]
        self.expert_parallel_buffers = [_Buf(b) for b in expert]


def test_param_buffers_lists_dense_then_expert_buffers_of_every_chunk():
    a, b, e = torch.zeros(4), torch.zeros(2), torch.zeros(3)
    got = am.param_buffers([_DDP([a, b], [e]), _DDP([], [])])
    assert [t.data_ptr() for t in got] == [a.data_ptr(), b.data_ptr(), e.data_ptr()]
    assert am.param_buffers(torch.nn.Linear(2, 2)) == []
