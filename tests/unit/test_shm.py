"""shardtrain.shm: segments are reused only once the receiver let go, refused when stale, and always removed."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from shardtrain import shm
from shardtrain.errors import DataLoss, InvalidArgument

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs /dev/shm")


def own_segments() -> set[str]:
    return {str(p) for p in pathlib.Path(shm.DIRECTORY).glob(f"shardtrain-{os.getpid()}-*")}


@pytest.fixture
def pool():
    segments = shm.SegmentPool(max_segments=2)
    yield segments
    segments.close()
    assert not own_segments()


def put(pool: shm.SegmentPool, tensor: torch.Tensor):
    flat = tensor.reshape(-1).view(torch.uint8)
    return pool.put(flat), flat.numel()


def test_receiver_maps_the_bytes_the_sender_put(pool):
    original = torch.randn(50_000)
    (path, offset, generation), nbytes = put(pool, original)
    received = shm.open_segment(path, offset, generation, nbytes).view(torch.float32)
    assert torch.equal(received, original)


def test_a_busy_segment_is_not_reused_until_the_receiver_drops_its_tensor(pool):
    first, nbytes = put(pool, torch.ones(20_000))
    received = shm.open_segment(*first, nbytes)
    second, _ = put(pool, torch.zeros(20_000))
    assert second[0] != first[0]  # the first is still in use: a second segment
    assert torch.equal(received.view(torch.float32), torch.ones(20_000))
    del received
    gc.collect()
    third, _ = put(pool, torch.full((20_000,), 2.0))
    assert third[0] == first[0] and third[2] == first[2] + 1


def test_a_handle_received_twice_frees_its_segment_once_both_tensors_are_gone(pool):
    first, nbytes = put(pool, torch.ones(20_000))
    once, twice = shm.open_segment(*first, nbytes), shm.open_segment(*first, nbytes)
    del once
    gc.collect()
    second, _ = put(pool, torch.zeros(20_000))
    assert second[0] != first[0]  # `twice` still reads the first segment: it is not handed back yet
    assert torch.equal(twice.view(torch.float32), torch.ones(20_000))
    del twice
    gc.collect()
    third, _ = put(pool, torch.full((20_000,), 2.0))
    assert third[0] == first[0] and third[2] == first[2] + 1


def test_when_every_segment_is_busy_put_says_so(pool):
    put(pool, torch.ones(20_000))
    put(pool, torch.ones(20_000))
    assert put(pool, torch.ones(20_000))[0] is None  # the caller streams instead


def test_a_stale_generation_is_data_loss(pool):
    (path, offset, generation), nbytes = put(pool, torch.ones(20_000))
    with pytest.raises(DataLoss, match="generation"):
        shm.open_segment(path, offset, generation + 1, nbytes)


def test_bytes_outside_the_segment_are_refused(pool):
    (path, offset, generation), nbytes = put(pool, torch.ones(20_000))
    with pytest.raises(InvalidArgument, match="outside"):
        shm.open_segment(path, offset, generation, nbytes * 100)


@pytest.mark.parametrize("path", ["/etc/passwd", "/dev/shm/../etc/passwd", "/dev/shm/shardtrain-1-xyz",
                                  "/dev/shm/other-file"])
def test_paths_that_are_not_segments_are_refused(path):
    with pytest.raises(InvalidArgument, match="not a shardtrain segment"):
        shm.open_segment(path, shm.DATA_OFFSET, 1, 4)
    with pytest.raises(InvalidArgument):
        shm.read_probe(path)


def test_a_segment_that_is_gone_is_data_loss():
    with pytest.raises(DataLoss, match="cannot be opened"):
        shm.open_segment(f"{shm.DIRECTORY}/shardtrain-1-0123456789abcdef", shm.DATA_OFFSET, 1, 4)


def test_probe_token_reads_back():
    path, token = shm.write_probe()
    try:
        assert shm.read_probe(path) == token
    finally:
        shm.remove(path)


def test_close_unlinks_but_the_receiver_keeps_its_tensor():
    pool = shm.SegmentPool()
    (path, offset, generation), nbytes = put(pool, torch.arange(30_000, dtype=torch.float32))
    received = shm.open_segment(path, offset, generation, nbytes)
    pool.close()
    assert not os.path.exists(path)
    assert torch.equal(received.view(torch.float32), torch.arange(30_000, dtype=torch.float32))


def test_segments_of_a_sigkilled_process_are_swept():
    script = ("import os, signal, torch; from shardtrain import shm; pool = shm.SegmentPool();"
              "print(pool.put(torch.ones(100_000, dtype=torch.uint8))[0], flush=True);"
              "os.kill(os.getpid(), signal.SIGKILL)")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    path = child.stdout.strip()
    assert child.returncode == -9 and os.path.exists(path)  # SIGKILL skipped every cleanup
    assert path in shm.sweep()
    assert not os.path.exists(path)


def test_sweep_leaves_live_processes_alone(pool):
    put(pool, torch.ones(20_000))
    shm.sweep()
    assert len(own_segments()) == 1


def test_a_receiver_maps_a_segment_once_and_hands_it_back_after_each_tensor(pool, monkeypatch):
    mapped = []
    real_map = shm._map
    monkeypatch.setattr(shm, "_map", lambda path: mapped.append(path) or real_map(path))
    mappings = shm.Mappings()
    for value in range(3):
        (path, offset, generation), nbytes = put(pool, torch.full((20_000,), float(value)))
        received = mappings.view(path, offset, generation, nbytes).view(torch.float32)
        assert torch.equal(received, torch.full((20_000,), float(value)))
        del received
        gc.collect()
    assert len(mapped) == 1 and len(mappings) == 1  # one segment, mapped once, kept
    assert put(pool, torch.ones(20_000))[0][2] == generation + 1  # and handed back: the same segment again


def test_a_mapping_in_use_is_kept_and_idle_ones_go_beyond_the_byte_budget(pool):
    mappings = shm.Mappings(keep_bytes=0)
    (path, offset, generation), nbytes = put(pool, torch.ones(20_000))
    received = mappings.view(path, offset, generation, nbytes)
    (path2, offset2, generation2), _ = put(pool, torch.ones(20_000))
    mappings.view(path2, offset2, generation2, nbytes)  # dropped at once: idle, over the budget, closed
    assert len(mappings) == 1
    assert torch.equal(received.view(torch.float32), torch.ones(20_000))
    del received
    gc.collect()
    assert len(mappings) == 0


def test_idle_mappings_are_closed_after_keep_seconds(pool):
    mappings = shm.Mappings(keep_seconds=0.0)
    (path, offset, generation), nbytes = put(pool, torch.ones(20_000))
    received = mappings.view(path, offset, generation, nbytes)
    assert len(mappings) == 1
    del received
    gc.collect()
    assert len(mappings) == 0


def test_a_stale_generation_in_a_kept_mapping_is_data_loss(pool):
    mappings = shm.Mappings()
    (path, offset, generation), nbytes = put(pool, torch.ones(20_000))
    received = mappings.view(path, offset, generation, nbytes)
    del received
    gc.collect()
    with pytest.raises(DataLoss, match="generation"):
        mappings.view(path, offset, generation, nbytes)  # handed back: that handle is spent


@pytest.fixture
def small_tmpfs(tmp_path, monkeypatch):
    """/dev/shm stood in for by a 1 MiB tmpfs (needs root to mount, as the CI machine has)."""
    mount = tmp_path / "shm"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=1777", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    monkeypatch.setattr(shm, "DIRECTORY", str(mount))
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_a_segment_that_does_not_fit_goes_by_stream_instead_of_killing_the_sender(small_tmpfs, monkeypatch):
    pool = shm.SegmentPool()
    try:
        assert put(pool, torch.ones(1 << 19))[0] is None  # 2 MiB into 1 MiB: on a sized file, SIGBUS
        assert not list(small_tmpfs.iterdir())
        assert put(pool, torch.ones(1 << 14))[0] is None  # 64 KiB would fit, but the pool waits before trying
        monkeypatch.setattr(shm, "FULL_RETRY_S", 0.0)
        pool._full_until = 0.0
        (path, offset, generation), nbytes = put(pool, torch.ones(1 << 14))
        assert torch.equal(shm.open_segment(path, offset, generation, nbytes).view(torch.float32),
                           torch.ones(1 << 14))
    finally:
        pool.close()


def test_a_probe_that_does_not_fit_raises_and_leaves_nothing(small_tmpfs):
    (small_tmpfs / "filler").write_bytes(b"\0" * (1 << 20))
    with pytest.raises(OSError):
        shm.write_probe()
    assert [p.name for p in small_tmpfs.iterdir()] == ["filler"]
