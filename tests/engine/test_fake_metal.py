"""The host engine end to end on Linux: objc_msgSend binding -> toy Objective-C runtime -> fake
Metal -> CPU harness, checked against numpy.

The fake Metal runs the dispatches between two barriers of a concurrent encoder in reverse (or
shuffled) order, so a missing barrier between dependent dispatches gives a wrong answer here.
"""

from __future__ import annotations

import gc
import mmap
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from lily._ext import _test_engine as te

pytestmark = pytest.mark.metal  # runs the metal backend (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
# What the engine compiles on a Mac; the fake library serves the harness's kernels instead.
KERNEL_SOURCE = "\n".join(
    p.read_text() for p in sorted((ROOT / "metal").glob("*.metal")) + [Path(__file__).with_name("engine_kernels.metal")]
)
EPS = 1e-6
F32 = 4


@pytest.fixture(autouse=True)
def reverse_order():
    if not hasattr(te, "set_stage_order"):  # a real GPU: its own dispatch order
        yield
        return
    te.set_stage_order("reverse")
    yield
    te.set_stage_order("reverse")


@pytest.fixture
def device() -> te.Device:
    return te.Device(KERNEL_SOURCE)


def rms_norm_reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + EPS) * weight.astype(np.float64)


def rms_args(row_length: int) -> bytes:
    return struct.pack("<IfII", row_length, EPS, 0, 0)  # lily::RmsNormArgs


def upload(device: te.Device, values: np.ndarray) -> te.Buffer:
    buffer = device.buffer(values.nbytes)
    buffer.array()[:] = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
    return buffer


def download(buffer: te.Buffer, shape, offset: int = 0) -> np.ndarray:
    count = int(np.prod(shape))
    return buffer.array()[offset : offset + count * F32].view(np.float32).reshape(shape).copy()


def whole(buffer: te.Buffer) -> tuple:
    return (buffer, 0, buffer.length)


def dispatch_rms_norm(encoder, device, x, weight, out, rows, row_length, threads=64):
    encoder.dispatch(
        device.pipeline("rms_norm_f32"),
        [rms_args(row_length), x, weight, out],
        (rows, 1, 1),
        (threads, 1, 1),
        reads=[whole(x), whole(weight)],
        writes=[whole(out)],
    )


def dispatch_scale(encoder, device, x, y, scale, count, x_offset=0, y_offset=0, constants=None):
    """y[y_offset:] = scale * x[x_offset:] over `count` floats (offsets in floats)."""
    encoder.dispatch(
        device.pipeline("engine_scale", constants or {}),
        [(x, x_offset * F32), (y, y_offset * F32), struct.pack("<f", scale), struct.pack("<I", count)],
        ((count + 31) // 32, 1, 1),
        (32, 1, 1),
        reads=[(x, x_offset * F32, count * F32)],
        writes=[(y, y_offset * F32, count * F32)],
    )


@pytest.mark.parametrize("rows,row_length,threads", [(1, 32, 32), (3, 100, 64), (2, 1025, 256), (4, 63, 33)])
def test_rms_norm_through_the_binding_matches_numpy(device, rows, row_length, threads):
    rng = np.random.default_rng(rows * 1000 + row_length)
    x = rng.standard_normal((rows, row_length)).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(row_length)).astype(np.float32)
    bx, bw, bout = upload(device, x), upload(device, weight), device.buffer(x.nbytes)
    encoder = te.Encoder(device)
    dispatch_rms_norm(encoder, device, bx, bw, bout, rows, row_length, threads)
    encoder.commit()
    encoder.wait()
    np.testing.assert_allclose(download(bout, x.shape), rms_norm_reference(x, weight), rtol=2e-6, atol=2e-6)


def run_rms_chain(device, x, w1, w2, barrier: bool, automatic: bool = False):
    rows, n = x.shape
    bx, b1, b2 = upload(device, x), upload(device, w1), upload(device, w2)
    by, bz = device.buffer(x.nbytes), device.buffer(x.nbytes)
    encoder = te.Encoder(device, automatic_barriers=automatic)
    dispatch_rms_norm(encoder, device, bx, b1, by, rows, n)
    if barrier:
        encoder.barrier()
    dispatch_rms_norm(encoder, device, by, b2, bz, rows, n)
    encoder.commit()
    encoder.wait()
    return download(bz, x.shape), encoder.counters


@pytest.mark.fake_metal
@pytest.mark.parametrize("order", ["reverse", "shuffle"])
def test_dependent_chain_is_right_with_the_barrier_and_wrong_without(device, order):
    te.set_stage_order(order, seed=7)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    w1 = rng.uniform(0.5, 1.5, 96).astype(np.float32)
    w2 = rng.uniform(0.5, 1.5, 96).astype(np.float32)
    expected = rms_norm_reference(rms_norm_reference(x, w1).astype(np.float32), w2)

    with_barrier, counters = run_rms_chain(device, x, w1, w2, barrier=True)
    np.testing.assert_allclose(with_barrier, expected, rtol=2e-6, atol=2e-6)
    assert (counters["stages"], counters["barriers"]) == (2, 1)

    without_barrier, counters = run_rms_chain(device, x, w1, w2, barrier=False)
    assert counters["stages"] == 1
    assert np.max(np.abs(without_barrier - expected)) > 0.5  # the second norm read y before it was written


@pytest.mark.fake_metal
def test_automatic_barrier_on_a_dependent_chain(device):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    w1 = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    w2 = rng.uniform(0.5, 1.5, 64).astype(np.float32)
    te.reset_fake_stats()
    result, counters = run_rms_chain(device, x, w1, w2, barrier=False, automatic=True)
    np.testing.assert_allclose(
        result, rms_norm_reference(rms_norm_reference(x, w1).astype(np.float32), w2), rtol=2e-6, atol=2e-6
    )
    assert (counters["dispatches"], counters["stages"], counters["barriers"]) == (2, 2, 1)
    stats = te.fake_stats()
    assert (stats["dispatches"], stats["barriers"]) == (2, 1)  # the barrier reached the fake GPU


def test_automatic_barriers_only_where_ranges_conflict(device):
    """Hand-checked stage counts for each hazard kind, with the results checked too."""
    rng = np.random.default_rng(3)
    a = rng.standard_normal(256).astype(np.float32)
    ba, bb, bc = upload(device, a), device.buffer(1024), device.buffer(1024)
    encoder = te.Encoder(device)
    dispatch_scale(encoder, device, ba, bb, 2.0, 128, 0, 0)  # stage 1: b[0:128] = 2a[0:128]
    dispatch_scale(encoder, device, ba, bb, 3.0, 128, 128, 128)  # disjoint write, shared read: stage 1
    dispatch_scale(encoder, device, ba, bc, 5.0, 256)  # reads only a: stage 1
    dispatch_scale(encoder, device, bb, bc, 7.0, 64, 100, 0)  # reads b[100:164] (RAW), writes c (WAW): stage 2
    dispatch_scale(encoder, device, bc, bb, 11.0, 32, 200, 100)  # writes b[100:132], read in stage 2 (WAR): stage 3
    dispatch_scale(encoder, device, ba, ba, 13.0, 16, 0, 240)  # writes a[240:256]: read in stage 1 only: stage 3
    encoder.commit()
    encoder.wait()

    b = np.concatenate([2 * a[:128], 3 * a[128:]]).astype(np.float32)
    c = (5 * a).astype(np.float32)
    c[:64] = 7 * b[100:164]
    b[100:132] = 11 * c[200:232]
    a_after = a.copy()
    a_after[240:] = 13 * a[:16]
    np.testing.assert_allclose(download(bb, 256), b, rtol=1e-6)
    np.testing.assert_allclose(download(bc, 256), c, rtol=1e-6)
    np.testing.assert_allclose(download(ba, 256), a_after, rtol=1e-6)
    assert encoder.counters == {
        "dispatches": 6,
        "stages": 3,
        "barriers": 2,
        "encoders": 1,
        "bytes_read": (128 + 128 + 256 + 64 + 32 + 16) * F32,
        "bytes_written": (128 + 128 + 256 + 64 + 32 + 16) * F32,
    }


def sequential_reference(buffers: list[np.ndarray], ops) -> list[np.ndarray]:
    out = [b.copy() for b in buffers]
    for src, dst, scale, count, src_off, dst_off in ops:
        out[dst][dst_off : dst_off + count] = (scale * out[src][src_off : src_off + count]).astype(np.float32)
    return out


def greedy_stage_count(ops) -> int:
    """The barrier rule restated independently: a new stage at the first conflicting dispatch."""
    stages, reads, writes = 0, [], []

    def overlaps(ranges, r):
        return any(b == r[0] and s < r[2] and r[1] < e for b, s, e in ranges)

    for src, dst, _, count, src_off, dst_off in ops:
        r = (src, src_off, src_off + count)
        w = (dst, dst_off, dst_off + count)
        if stages == 0 or overlaps(writes, r) or overlaps(reads, w) or overlaps(writes, w):
            stages, reads, writes = stages + 1, [], []
        reads.append(r)
        writes.append(w)
    return stages


@pytest.mark.fake_metal
@pytest.mark.parametrize("order", ["reverse", "shuffle"])
@pytest.mark.parametrize("seed", range(4))
def test_random_dispatch_graphs_match_sequential_execution(device, order, seed):
    te.set_stage_order(order, seed=seed)
    rng = np.random.default_rng(100 + seed)
    size = 96
    host = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    buffers = [upload(device, h) for h in host]
    ops = []
    for _ in range(12):
        src, dst = rng.integers(0, 3, 2)
        count = int(rng.integers(1, 48))
        src_off, dst_off = (int(v) for v in rng.integers(0, size - count + 1, 2))
        if src == dst and abs(src_off - dst_off) < count:
            continue  # a dispatch reading and writing overlapping bytes races with itself
        ops.append((int(src), int(dst), float(rng.choice([0.5, -1.0, 2.0])), count, src_off, dst_off))
    encoder = te.Encoder(device)
    for src, dst, scale, count, src_off, dst_off in ops:
        dispatch_scale(encoder, device, buffers[src], buffers[dst], scale, count, src_off, dst_off)
    encoder.commit()
    encoder.wait()
    for got, want in zip(buffers, sequential_reference(host, ops)):
        np.testing.assert_allclose(download(got, size), want, rtol=1e-6)
    assert encoder.counters["stages"] == greedy_stage_count(ops)
    assert encoder.counters["barriers"] == encoder.counters["stages"] - 1


def test_pipeline_cache_hits_and_function_constant_variants(device):
    plain = device.pipeline("engine_scale")
    assert device.pipeline("engine_scale") is plain
    assert device.pipeline_cache_stats() == (1, 1, 1)  # (entries, hits, misses)
    with_one = device.pipeline("engine_scale", {0: True})
    without_one = device.pipeline("engine_scale", {0: False})
    assert with_one is not without_one and with_one is not plain
    assert device.pipeline("engine_scale", {0: True}) is with_one
    assert device.pipeline_cache_stats() == (3, 2, 3)

    rng = np.random.default_rng(4)
    x = rng.standard_normal(70).astype(np.float32)
    bx = upload(device, x)
    outputs = {name: device.buffer(x.nbytes) for name in ("plain", "true", "false")}
    encoder = te.Encoder(device)
    dispatch_scale(encoder, device, bx, outputs["plain"], 3.0, 70)
    dispatch_scale(encoder, device, bx, outputs["true"], 3.0, 70, constants={0: True})
    dispatch_scale(encoder, device, bx, outputs["false"], 3.0, 70, constants={0: False})
    encoder.commit()
    encoder.wait()
    np.testing.assert_allclose(download(outputs["plain"], 70), 3 * x, rtol=1e-6)
    np.testing.assert_allclose(download(outputs["true"], 70), 3 * x + 1, rtol=1e-6)
    np.testing.assert_allclose(download(outputs["false"], 70), 3 * x, rtol=1e-6)
    assert encoder.counters["stages"] == 1  # three independent outputs


def test_unknown_kernel_gives_metal_error_message(device):
    not_found = r"cannot create kernel 'no_such_kernel': Function no_such_kernel was not found"
    with pytest.raises(RuntimeError, match=not_found):
        device.pipeline("no_such_kernel")
    out_of_range = r"function constant 0 of kernel 'engine_scale' is out of range for its type; got 1099511627776"
    with pytest.raises(RuntimeError, match=out_of_range):
        device.pipeline("engine_scale", {0: 2**40})
    assert device.pipeline_cache_stats() == (0, 0, 2)  # failures are not cached


def test_compile_error_and_fast_math_rule():
    compile_error = r"cannot compile the kernel library: program_source:5: error: broken kernel"
    with pytest.raises(RuntimeError, match=compile_error):
        te.Device("#if defined(NOT_HERE)\n#error not compiled\n#endif\nkernel void f() {}\n  #  error broken kernel\n")
    with pytest.raises(RuntimeError, match="source is empty"):
        te.Device("   \n")


def test_kernel_failure_fails_the_command_buffer_with_its_message(device):
    x = upload(device, np.ones((1, 32), np.float32))
    out = device.buffer(128)
    seen = []
    encoder = te.Encoder(device)
    encoder.add_completed_handler(seen.append)
    encoder.dispatch(
        device.pipeline("rms_norm_f32"),
        [struct.pack("<If", 32, EPS), x, x, out],  # 8 bytes where RmsNormArgs has 16
        (1, 1, 1),
        (32, 1, 1),
        reads=[whole(x)],
        writes=[whole(out)],
    )
    encoder.commit()
    with pytest.raises(RuntimeError, match=r"command buffer failed: kernel rms_norm_f32 failed: .*16"):
        encoder.wait()
    assert len(seen) == 1 and "rms_norm_f32" in seen[0]


def test_completion_handler_runs_once_after_the_work(device):
    x = np.arange(64, dtype=np.float32)
    bx, by = upload(device, x), device.buffer(x.nbytes)
    seen = []
    encoder = te.Encoder(device)
    dispatch_scale(encoder, device, bx, by, 2.0, 64)
    encoder.add_completed_handler(lambda error: seen.append((error, download(by, 64))))
    assert seen == []
    encoder.commit()
    encoder.wait()
    assert len(seen) == 1 and seen[0][0] == ""
    np.testing.assert_array_equal(seen[0][1], 2 * x)


def test_shared_events_order_command_buffers_and_the_cpu(device):
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    bx, by, bz = upload(device, x), device.buffer(x.nbytes), device.buffer(x.nbytes)
    event = device.event()
    # One queue runs its command buffers in commit order, so the producer goes first.
    producer = te.Encoder(device)  # y = 2x, once the CPU has signalled 1
    producer.wait_for_event(event, 1)
    dispatch_scale(producer, device, bx, by, 2.0, 64)
    producer.signal_event(event, 2)
    producer.commit()
    consumer = te.Encoder(device)  # z = 3y, once the producer has signalled 2
    consumer.wait_for_event(event, 2)
    dispatch_scale(consumer, device, by, bz, 3.0, 64)
    consumer.signal_event(event, 3)
    consumer.commit()

    assert not event.wait(2, timeout_ms=1)
    np.testing.assert_array_equal(download(by, 64), 0)  # both blocked on the CPU's signal
    np.testing.assert_array_equal(download(bz, 64), 0)
    event.signal(1)
    producer.wait()
    consumer.wait()
    assert event.value == 3 and event.wait(3, timeout_ms=1)
    np.testing.assert_allclose(download(by, 64), 2 * x, rtol=1e-6)
    np.testing.assert_allclose(download(bz, 64), 6 * x, rtol=1e-6)
    assert consumer.counters["encoders"] == 1


def test_event_signalled_from_another_thread_releases_a_waiting_command_buffer(device):
    x = np.arange(32, dtype=np.float32)
    bx, by = upload(device, x), device.buffer(x.nbytes)
    event = device.event()
    seen = []
    encoder = te.Encoder(device)
    encoder.wait_for_event(event, 5)
    dispatch_scale(encoder, device, bx, by, -1.0, 32)
    encoder.add_completed_handler(lambda error: seen.append((threading.get_ident(), error)))
    encoder.commit()
    signaller = threading.Timer(0.05, event.signal, (5,))
    signaller.start()
    encoder.wait()  # blocks until the other thread's signal has run the command buffer
    signaller.join()
    assert seen == [(signaller.ident, "")]
    np.testing.assert_array_equal(download(by, 32), -x)


def test_no_copy_buffer_wraps_page_aligned_memory(device):
    page = 16384  # Apple-silicon page size
    region = mmap.mmap(-1, 4 * page)
    raw = np.frombuffer(region, dtype=np.uint8)
    start = (-raw.ctypes.data) % page
    window = raw[start : start + 2 * page]
    wrapped = device.wrap(window, region)
    assert wrapped.address == window.ctypes.data and wrapped.length == 2 * page
    x = np.arange(100, dtype=np.float32)
    bx = upload(device, x)
    encoder = te.Encoder(device)
    dispatch_scale(encoder, device, bx, wrapped, -2.0, 100, 0, 1000)
    encoder.commit()
    encoder.wait()
    np.testing.assert_array_equal(window[4000:4400].view(np.float32), -2 * x)  # written in place
    with pytest.raises(RuntimeError, match="page-aligned"):
        device.wrap(raw[start + 64 : start + 64 + page], region)
    del wrapped, window, raw
    gc.collect()
    region.close()


def test_bad_dispatches_raise_clear_errors(device):
    x = device.buffer(256)
    pipeline = device.pipeline("engine_scale")
    encoder = te.Encoder(device)
    too_many = r"kernel 'engine_scale': threads per threadgroup must be 1 to 1024; got 2048"
    with pytest.raises(RuntimeError, match=too_many):
        encoder.dispatch(pipeline, [x, x], (1, 1, 1), (2048, 1, 1), reads=[], writes=[])
    outside = r"kernel 'engine_scale': read range \[200, \+100\) is not inside its buffer of 256"
    with pytest.raises(RuntimeError, match=outside):
        encoder.dispatch(pipeline, [x, x], (1, 1, 1), (32, 1, 1), reads=[(x, 200, 100)], writes=[])
    with pytest.raises(RuntimeError, match="bytes argument holds 1 to 4096 bytes; got 5000"):
        encoder.dispatch(pipeline, [bytes(5000)], (1, 1, 1), (32, 1, 1), reads=[], writes=[])
    with pytest.raises(RuntimeError, match="a dispatch of engine_scale binds 32 arguments; Metal allows 31"):
        encoder.dispatch(pipeline, [x] * 32, (1, 1, 1), (32, 1, 1), reads=[], writes=[])
    with pytest.raises(RuntimeError, match="offset 256 is not inside the buffer's 256 bytes"):
        encoder.dispatch(pipeline, [(x, 256)], (1, 1, 1), (32, 1, 1), reads=[], writes=[])
    with pytest.raises(RuntimeError, match="wait before commit"):
        encoder.wait()
    encoder.commit()
    with pytest.raises(RuntimeError, match="dispatch after commit"):
        encoder.dispatch(pipeline, [x, x], (1, 1, 1), (32, 1, 1), reads=[], writes=[])
    encoder.wait()


def test_a_buffer_offset_not_aligned_to_what_the_kernel_reads_fails_the_command_buffer(device):
    """Metal wants setBuffer offsets aligned to the kernel's element type; the CPU would read anywhere, so the fake
    checks it, as a GPU would fault or read the wrong bytes."""
    x, y = device.buffer(1024), device.buffer(1024)
    for offset, fails in ((4, False), (2, True), (1, True)):
        encoder = te.Encoder(device)
        encoder.dispatch(device.pipeline("engine_scale"), [(x, offset), (y, 0), struct.pack("<f", 2.0),
                                                           struct.pack("<I", 8)],
                         (1, 1, 1), (32, 1, 1), reads=[(x, offset, 32)], writes=[(y, 0, 32)])
        encoder.commit()
        if fails:
            with pytest.raises(RuntimeError, match=rf"\[\[buffer\(0\)\]\] at offset {offset} is not aligned to its "
                                                   r"4-byte elements"):
                encoder.wait()
        else:
            encoder.wait()


@pytest.mark.fake_metal
def test_binding_releases_every_object_it_creates():
    gc.collect()
    baseline = te.live_objects()
    device = te.Device(KERNEL_SOURCE)
    x = upload(device, np.ones(64, np.float32))
    y = device.buffer(256)
    event = device.event()
    encoder = te.Encoder(device)
    encoder.add_completed_handler(lambda error: None)
    dispatch_scale(encoder, device, x, y, 2.0, 64, constants={0: True})
    encoder.signal_event(event, 1)
    encoder.commit()
    encoder.wait()
    with pytest.raises(RuntimeError):
        device.pipeline("no_such_kernel")
    assert te.live_objects() > baseline
    del device, x, y, event, encoder
    gc.collect()
    assert te.live_objects() == baseline
