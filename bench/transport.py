"""Benchmark: moving one tensor between two processes, shardtrain's ways against torch.distributed's.

    python -m bench.transport [--sizes 4K 1M 64M 256M] [--compression] [--chunk-sweep 256K 4M]
                              [--repeats N] [--tuned-baselines] [--device cuda] [--tls] [--checksums]

One transfer moves a float32 tensor from a sender process to a receiver process, which builds a
fresh tensor from it and acknowledges; latency is the sender's wall time from the start of the
transfer to the acknowledgement (median of the repeats). Ways measured in the same run:

- shardtrain gRPC: the shards' own path (wire.tensor_frames -> codec.Frame -> grpc.aio ->
  TensorStreamReader), on a call opened beforehand, as a shard opens its downstream call while it
  computes (`new call` rows add the call setup);
- shardtrain gRPC, plain protobuf: the same, with the chunk data set as an ordinary protobuf field
  (what the codec removes), for the before/after of the copies;
- shardtrain same-host: the shared-memory segment path (shm.py);
- shardtrain TCP link: a Link's own TCP socket (carrier.py), the path between hosts, as a forward
  item's frames, acknowledged by a small item back; with --tls, the same over TLS as between hosts of
  a deployment that uses TLS (a self-signed certificate made with the openssl command); with --checksums,
  the same with each chunk's CRC-32C and CRC-32 computed by the sender and checked by the receiver;
- torch.rpc echo (TensorPipe) and gloo send/recv + ack: bench/transport_baselines.py.

Receiver peak RSS: the receiver resets its peak (/proc/self/clear_refs) before a size's timed
transfers; extra = peak - RSS before - one destination tensor, reported per byte received.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.transport_baselines import (TransferResult, default_repeats, peak_rss, reset_peak_rss,  # noqa: E402
                                       run_gloo, run_torch_rpc)
from shardtrain import carrier, channels, link_streams, rpc, shm, wire  # noqa: E402
from shardtrain.lifecycle import keep_freed_memory  # noqa: E402
from shardtrain.codec import Codec, Frame  # noqa: E402
from shardtrain.settings import Security  # noqa: E402
from shardtrain.v1 import shard_pb2, tensor_pb2  # noqa: E402

SERVICE = "shardtrain.bench.Transfer"
CHUNK_CODEC = Codec(tensor_pb2.TensorChunk)
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4K', '64M' -> bytes."""
    return int(text[:-1]) * UNITS[text[-1].upper()] if text[-1].upper() in UNITS else int(text)


def _plain_serialize(frame: Frame) -> bytes:
    """A chunk as naive code sends it: the data set as a protobuf field, then the message serialized."""
    message = tensor_pb2.TensorChunk()
    message.CopyFrom(frame.message)
    message.data = bytes(frame.data)
    return message.SerializeToString()


def _plain_deserialize(raw: bytes) -> Frame:
    message = tensor_pb2.TensorChunk.FromString(raw)
    return Frame(message, message.data)


# --- receiver -------------------------------------------------------------------------------

async def _echo_link(offered: asyncio.Future) -> None:
    """The receiver's end of a TCP link: acknowledges each complete item with a flush naming when it arrived."""
    local = await offered
    items = link_streams.ItemReader()
    while (frame := await local.read()) is not None:
        item = items.feed(frame)
        if item is not None:
            arrived = time.monotonic_ns()
            del item
            await local.write(Frame(shard_pb2.LinkMessage(flush=shard_pb2.Flush(optimizer_step=arrived))))


async def _serve(device: str, tls_cert: str = "", tls_key: str = "") -> None:
    rss_before = 0
    listener = carrier.Listener(unix=False, tcp_bind="127.0.0.1", tcp_advertise="127.0.0.1")
    tls_listener = carrier.Listener(unix=False, tcp_bind="127.0.0.1", tcp_advertise="127.0.0.1",
                                    tls=rpc.tls_server_context(Security(tls_cert=tls_cert, tls_key=tls_key)))

    async def put(frames, context):
        received = await wire.collect(frames, count=1)  # as a shard's Forward reads its activation
        if device != "cpu":  # a CUDA shard moves what it received onto its device before using it
            received = {name: tensor.to(device, non_blocking=True) for name, tensor in received.items()}
            torch.cuda.synchronize()
        arrived = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process of this host
        del received  # the destination lives until the ack, like an activation until the stage ran
        return struct.pack("<q", arrived)

    async def control(request: bytes, context) -> bytes:
        nonlocal rss_before
        command = json.loads(request)
        if command["op"] == "reset":
            rss_before = reset_peak_rss()
            return b"{}"
        if command["op"] == "offer":
            address, token, offered = await (tls_listener if command.get("tls") else listener).offer(same_host=False)
            asyncio.ensure_future(_echo_link(offered))
            return json.dumps({"address": address, "token": token.hex()}).encode()
        return json.dumps({"extra": peak_rss() - rss_before}).encode()

    server = rpc.new_server(Security())
    handlers = {
        "Put": grpc.stream_unary_rpc_method_handler(put, CHUNK_CODEC.deserialize, None),
        "PutPlain": grpc.stream_unary_rpc_method_handler(put, _plain_deserialize, None),
        "Control": grpc.unary_unary_rpc_method_handler(control),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = rpc.bind(server, "127.0.0.1:0", Security())
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    await server.wait_for_termination()


# --- sender ---------------------------------------------------------------------------------

@dataclass
class Way:
    """One shardtrain way of sending."""

    name: str
    method: str
    serialize: object
    shared: bool = False
    encoding: int = tensor_pb2.ENCODING_NONE
    preopened: bool = True
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    channels: int = 1  # >1: the tensor is cut into that many parts, each on its own channel at once
    tls: bool = False  # the TCP link over TLS
    checksum: str = "off"  # what each chunk carries of its data (shardtrain.checksums)


async def _requests(tensor: torch.Tensor, options: wire.SendOptions, start: asyncio.Future):
    await start
    for frame in wire.tensor_frames(tensor, "t", options):
        yield frame


class Sender:
    """The sending side, talking to one receiver process."""

    def __init__(self, address: str, device: str = "cpu", tls_ca: str = ""):
        self.device, self.address, self.tls_ca = device, address, tls_ca
        self.channel = channels.open_channel(address, Security())
        self.channels = [self.channel]
        self.segments = shm.SegmentPool()
        self._control = self.channel.unary_unary(f"/{SERVICE}/Control")
        self._links: dict[bool, carrier.Carrier] = {}  # the TCP links (plain, TLS), once a way uses them

    async def transfer(self, way: Way, tensor: torch.Tensor) -> tuple[float, float]:
        """Seconds from starting to send `tensor` until it was complete at the receiver, and until acknowledged."""
        options = wire.SendOptions(way.chunk_bytes, way.encoding, self.segments if way.shared else None, way.checksum)
        if way.method == "link":
            return await self._over_link(tensor, options, way.tls)
        later = asyncio.get_running_loop().create_future()
        parts = torch.tensor_split(tensor, way.channels)
        pending = [self._channel(index).stream_unary(f"/{SERVICE}/{way.method}", request_serializer=way.serialize)(
            _requests(part, options, later)) for index, part in enumerate(parts)]
        if way.preopened:
            await asyncio.sleep(0.002)  # let the call be set up, as a shard's downstream call is
        start = time.monotonic_ns()
        later.set_result(None)
        arrived = max(struct.unpack("<q", answer)[0] for answer in await asyncio.gather(*pending))
        return (arrived - start) / 1e9, (time.monotonic_ns() - start) / 1e9

    async def _over_link(self, tensor: torch.Tensor, options: wire.SendOptions, tls: bool) -> tuple[float, float]:
        if tls not in self._links:
            offer = json.loads(await self._control(json.dumps({"op": "offer", "tls": tls}).encode()))
            self._links[tls] = await carrier.connect(offer["address"], bytes.fromhex(offer["token"]),
                                                     rpc.tls_client_context(Security(tls_ca=self.tls_ca)) if tls
                                                     else None)
        local = self._links[tls]
        start = time.monotonic_ns()
        for frame in link_streams.frames(shard_pb2.LinkMessage(forward=shard_pb2.ForwardHeader()), tensor, options):
            await local.write(frame)
        arrived = (await local.read()).message.flush.optimizer_step
        return (arrived - start) / 1e9, (time.monotonic_ns() - start) / 1e9

    def _channel(self, index: int) -> grpc.aio.Channel:
        """Channel `index`: each its own TCP connection (a distinct option keeps grpc from sharing one)."""
        while len(self.channels) <= index:
            options = [*channels.CHANNEL_OPTIONS, ("shardtrain.bench.channel", len(self.channels))]
            self.channels.append(grpc.aio.insecure_channel(self.address, options=options))
        return self.channels[index]

    async def measure(self, way: Way, nbytes: int, repeats: int) -> TransferResult:
        """Median latency of `repeats` transfers of a float32 tensor of `nbytes`, and the receiver's extra RSS."""
        tensor = torch.randn(max(nbytes // 4, 1), device=self.device)  # on CUDA: staged through pinned memory
        for _ in range(2):
            await self.transfer(way, tensor)
        await self._control(json.dumps({"op": "reset"}).encode())
        times = [await self.transfer(way, tensor) for _ in range(repeats)]
        extra = json.loads(await self._control(json.dumps({"op": "peak"}).encode()))["extra"]
        latency = statistics.median(acked for _, acked in times)
        return TransferResult(way.name, nbytes, latency, nbytes / latency / 1e9, (extra - nbytes) / nbytes,
                              statistics.median(hop for hop, _ in times))

    async def close(self) -> None:
        for local in self._links.values():
            local.close()
        for channel in self.channels:
            await channel.close()
        self.segments.close()


def _start_receiver(device: str, tls: tuple[str, str] = ("", "")) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen([sys.executable, "-m", "bench.transport", "--serve", "--device", device,
                                "--tls-files", *tls],
                               stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = process.stdout.readline()
    if not line:
        process.kill()
        raise RuntimeError("the receiver process did not start")
    return process, f"127.0.0.1:{json.loads(line)['port']}"


def self_signed(directory: str) -> tuple[str, str]:
    """(certificate, key) for 127.0.0.1, made with the openssl command."""
    cert, key = os.path.join(directory, "cert.pem"), os.path.join(directory, "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=bench", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


def shardtrain_ways(compression: bool, chunk_sweep: list[int], tls: bool = False,
                    checksums: bool = False) -> list[Way]:
    """The ways to measure: the shards' path, its variants, and the chunk sizes to sweep."""
    ways = [Way("shardtrain gRPC", "Put", CHUNK_CODEC.serialize),
            Way("shardtrain gRPC, new call", "Put", CHUNK_CODEC.serialize, preopened=False),
            Way("shardtrain gRPC, plain protobuf", "PutPlain", _plain_serialize),
            Way("shardtrain same-host", "Put", CHUNK_CODEC.serialize, shared=True),
            Way("shardtrain TCP link", "link", None)]
    if tls:
        ways += [Way("shardtrain TCP link, TLS", "link", None, tls=True)]
    if checksums:
        ways += [Way(f"shardtrain TCP link, {kind}", "link", None, checksum=kind) for kind in ("crc32c", "crc32")]
    ways += [Way("shardtrain gRPC, 2 channels", "Put", CHUNK_CODEC.serialize, channels=2)]
    if compression:
        ways += [Way(f"shardtrain gRPC, {name}", "Put", CHUNK_CODEC.serialize, encoding=wire.encoding_code(name))
                 for name in ("fp16", "bf16", "int8")]
    ways += [Way(f"shardtrain gRPC, {size >> 10} KiB chunks", "Put", CHUNK_CODEC.serialize, chunk_bytes=size)
             for size in chunk_sweep]
    return ways


async def run_shardtrain(sizes: list[int], ways: list[Way], address: str, device: str,
                         repeats: int, tls_ca: str = "") -> list[TransferResult]:
    """Every shardtrain way at every size."""
    sender = Sender(address, device, tls_ca)
    try:
        return [await sender.measure(way, size, repeats or default_repeats(size)) for size in sizes for way in ways]
    finally:
        await sender.close()


def print_table(results: list[TransferResult]) -> None:
    """Latency, GB/s and extra RSS per way and size, with ratios to torch.rpc and gloo of the same size."""
    by_size: dict[int, list[TransferResult]] = {}
    for result in results:
        by_size.setdefault(result.nbytes, []).append(result)
    print(f"{'size':>8}  {'transport':<36} {'latency':>11} {'one hop':>11} {'GB/s':>7} {'x rpc':>6} {'x gloo':>6} "
          f"{'RSS/B':>6}")
    for nbytes, rows in by_size.items():
        base = {row.transport: row for row in rows}
        rpc_row, gloo_row = base.get("torch.rpc echo"), base.get("gloo send/recv")
        for row in rows:
            versus_rpc = rpc_row.latency_s / row.latency_s if rpc_row else float("nan")
            versus_gloo = gloo_row.latency_s / row.latency_s if gloo_row else float("nan")
            print(f"{_size(nbytes):>8}  {row.transport:<36} {row.latency_s * 1e3:>8.3f} ms {row.hop_s * 1e3:>8.3f} ms "
                  f"{row.gbps:>7.2f} "
                  f"{versus_rpc:>6.2f} {versus_gloo:>6.2f} {row.rss_per_byte:>6.2f}")
    print("latency: start of sending until the sender has the receiver's acknowledgement (torch.rpc: the echo's\n"
          "round trip); one hop: until the tensor is complete in the receiver (same-host monotonic clock).\n"
          "x rpc, x gloo: that baseline's latency / this latency (> 1: faster than the baseline).\n"
          "RSS/B: the receiver's peak extra memory beyond the destination tensor, per byte received.")


def _size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}iB"
    return f"{nbytes} B"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", nargs="+", default=["4K", "1M", "64M", "256M"])
    parser.add_argument("--compression", action="store_true", help="also fp16, bf16 and int8 wire encodings")
    parser.add_argument("--chunk-sweep", nargs="*", default=[], help="chunk sizes to try, e.g. 64K 256K 1M 3M")
    parser.add_argument("--skip-baselines", action="store_true")
    parser.add_argument("--repeats", type=int, default=0, help="timed transfers per size (default: by size)")
    parser.add_argument("--device", default="cpu", help="cuda: the sender's tensors live on the GPU and the "
                        "receiver moves them there (the CUDA variant; baselines stay on the CPU)")
    parser.add_argument("--tls", action="store_true", help="also the TCP link over TLS (needs the openssl command)")
    parser.add_argument("--checksums", action="store_true", help="also the TCP link with CRC-32C and CRC-32 chunks")
    parser.add_argument("--tls-files", nargs=2, default=["", ""], help=argparse.SUPPRESS)
    parser.add_argument("--tuned-baselines", action="store_true",
                        help="give the torch.distributed processes the same malloc settings as shardtrain's")
    args = parser.parse_args()
    keep_freed_memory()  # as shard processes do (lifecycle.py)
    torch.set_num_threads(1)
    if args.serve:
        asyncio.run(_serve(args.device, *args.tls_files))
        return
    if args.tuned_baselines:  # read by glibc when the baseline processes start
        os.environ.update(MALLOC_MMAP_THRESHOLD_=str(1 << 30), MALLOC_TRIM_THRESHOLD_=str(2**31 - 1))
    sizes = [parse_size(size) for size in args.sizes]
    ways = shardtrain_ways(args.compression, [parse_size(size) for size in args.chunk_sweep], args.tls, args.checksums)
    with tempfile.TemporaryDirectory() as directory:
        tls = self_signed(directory) if args.tls else ("", "")
        receiver, address = _start_receiver(args.device, tls)
        try:
            results = asyncio.run(run_shardtrain(sizes, ways, address, args.device, args.repeats, tls[0]))
        finally:
            receiver.kill()
            receiver.wait()
    if not args.skip_baselines:
        for size in sizes:
            repeats = args.repeats or default_repeats(size)
            results += run_torch_rpc([size], repeats) + run_gloo([size], repeats)
    print_table(sorted(results, key=lambda r: r.nbytes))


if __name__ == "__main__":
    main()
