"""The device interface: stream order, events and waits, on the CPU stand-in and (GPU marker) on CUDA."""

from __future__ import annotations

import pytest
import torch

from moecache.errors import MoecacheError
from moecache.runtime.device import CudaDevice, StandinDevice, make_device


def test_standin_runs_in_stream_order_only_when_told():
    d = StandinDevice("manual")
    s = d.new_stream()
    done = []
    event = d.new_event()
    assert event.query()  # never recorded: complete
    d.enqueue(s, lambda: done.append(1))
    event.record(s)
    d.enqueue(s, lambda: done.append(2))
    assert not event.query() and done == []
    d.run(s, max_ops=1)
    assert done == [1] and not event.query()
    d.run(s, max_ops=1)
    assert event.query() and done == [1]
    d.run()
    assert done == [1, 2]


def test_standin_wait_event_blocks_the_stream_until_the_event_completes():
    d = StandinDevice("manual")
    a, b = d.new_stream(), d.new_stream()
    event = d.new_event()
    order = []
    d.enqueue(a, lambda: order.append("a"))
    event.record(a)
    b.wait_event(event)
    d.enqueue(b, lambda: order.append("b"))
    d.run(b)
    assert order == []  # b is blocked on a's event
    d.run(a)
    d.run(b)
    assert order == ["a", "b"]


def test_standin_copy_happens_at_execution_and_modes():
    d = StandinDevice("manual")
    s = d.new_stream()
    dst, src = torch.zeros(3), torch.ones(3)
    d.copy(dst, src, s)
    src += 1  # the copy reads the source when it runs, as a device copy does
    assert dst.sum() == 0
    d.synchronize()
    assert dst.tolist() == [2, 2, 2]
    eager = StandinDevice("eager")
    d2 = torch.zeros(2)
    eager.copy(d2, torch.ones(2), eager.new_stream())
    assert d2.tolist() == [1, 1]
    with pytest.raises(MoecacheError, match="expected cuda, standin or auto"):
        make_device("tpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_event_orders_a_side_stream_after_compute():
    d = CudaDevice()
    side = d.new_stream()
    x = torch.zeros(1 << 22, device="cuda")
    y = torch.empty_like(x)
    event = d.new_event()
    x.add_(1)
    for _ in range(20):
        x.mul_(1.0)
    event.record(d.compute_stream())
    side.wait_event(event)
    d.copy(y, x, side)
    ready = d.new_event(timing=True)
    ready.record(side)
    d.synchronize()
    assert ready.query() and torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_drivers_copies_land_the_bytes_in_stream_order_from_any_thread():
    import threading

    from moecache.runtime.device import plain_pair

    d = CudaDevice()
    assert d.driver is not None  # libcuda loads wherever torch runs CUDA
    side = d.new_stream()
    src = torch.randn(3, 1 << 20, dtype=torch.bfloat16).pin_memory()
    dst = torch.full((3, 1 << 20), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert plain_pair(dst[0], src[0]) and not plain_pair(dst[0], src[0].float())
    busy = torch.randn(1 << 22, device="cuda")
    for _ in range(20):
        busy.mul_(1.0)  # the compute stream is busy: the side stream's wait must hold the copy back
    event = d.new_event()
    event.record(d.compute_stream())
    side.wait_event(event)
    d.driver.copy(dst[0].data_ptr(), src[0].data_ptr(), dst[0].nbytes, side.handle)
    errors = []

    def other_thread():  # the runtime has not used this thread: the copy sets the context first
        try:
            d.driver.copy(dst[1].data_ptr(), src[1].data_ptr(), dst[1].nbytes, side.handle)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    d.synchronize()
    assert not errors
    assert torch.equal(dst[:2].cpu(), src[:2]) and dst[2].isnan().all()
    with pytest.raises(MoecacheError, match="cuMemcpyAsync of 8 bytes returned CUDA error"):
        d.driver.copy(0, src[0].data_ptr(), 8, side.handle)  # no such device address
