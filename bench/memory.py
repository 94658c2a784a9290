"""Benchmark: memory of a model larger than the client should hold, built on meta with its weights read by the shards.

    python -m bench.memory [--hidden 1536] [--layers 16] [--intermediate 4096] [--shards 4] [--microbatches 8]

A transformers Llama of the given shape (about 550M parameters, 2.2 GB of float32, by default) is written as a
sharded safetensors checkpoint by a child process, one file at a time, so this process never holds it. Then this
process (the client) builds the model on the meta device and deploys it over local shards with weights= that
checkpoint, and runs one train_step of `--microbatches` micro-batches (GPipe, SGD with momentum) under
recompute="never", recompute="always" and precision="bf16". Printed, against the model's own size: the client's
peak resident set during all of that (sampled), each shard's peak against its weights + gradients + optimizer
state + peak activations (model.memory()), the activation bytes with and without recomputation, and the bytes
that crossed between stages in float32 and in bfloat16 (the shards' metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import transformers  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from client_sdk import Cluster  # noqa: E402
from shardtrain.checkpoint import write_safetensors  # noqa: E402

FILE_BYTES = 256 << 20


def config(args) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(vocab_size=args.vocabulary, hidden_size=args.hidden,
                                    intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                    num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 256,
                                    max_position_embeddings=args.sequence, use_cache=False)


def write_checkpoint(args, directory: str) -> None:
    """A Hugging Face sharded checkpoint of random weights, made one file's worth of tensors at a time."""
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(args))
    torch.manual_seed(0)
    weight_map, part, size, files = {}, {}, 0, []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        write_safetensors(pathlib.Path(directory, name), part)
        files.append(name)
        weight_map.update(dict.fromkeys(part, name))
        part.clear()

    for key, meta in model.state_dict().items():
        part[key] = torch.ones(meta.shape) if "norm" in key else torch.randn(meta.shape) * 0.02
        size += part[key].nbytes
        if size >= FILE_BYTES:
            flush()
            size = 0
    if part:
        flush()
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as index:
        json.dump({"metadata": {}, "weight_map": weight_map}, index)


class PeakResident:
    """The most this process's resident set was while it ran, sampled every 20 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            with open("/proc/self/statm") as statm:
                self.peak = max(self.peak, int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))

    def __enter__(self) -> PeakResident:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def stage_bytes(cluster) -> float:
    """Tensor bytes the shards sent each other and the client, as they travelled."""
    sent = 0.0
    for url in cluster.metrics_urls.values():
        with urllib.request.urlopen(url, timeout=10) as answer:
            for family in text_string_to_metric_families(answer.read().decode()):
                sent += sum(sample.value for sample in family.samples
                            if sample.name == "shardtrain_tensor_bytes_total"
                            and sample.labels.get("direction") == "sent")
    return sent


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--vocabulary", type=int, default=32000)
    parser.add_argument("--sequence", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--write-checkpoint", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args, args.write_checkpoint)
        return
    with tempfile.TemporaryDirectory() as directory:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "bench.memory", *sys.argv[1:], "--write-checkpoint", directory],
                       check=True)
        written = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
        print(f"checkpoint: {gib(written)} in {len(os.listdir(directory)) - 1} files, written in "
              f"{time.perf_counter() - start:.0f} s by a child process")
        run(args, directory, written)


def run(args, directory: str, written: int) -> None:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config(args))
    parameters = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocabulary, (args.batch, args.sequence))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    optimizer = (torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})
    results = {}
    with Cluster.local(num_shards=args.shards, data_roots=[directory], metrics=True) as cluster, \
            PeakResident() as client, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, options in (("fp32", {}), ("recompute", {"recompute": "always"}), ("bf16", {"precision": "bf16"})):
            start = time.perf_counter()
            remote = cluster.deploy(model, optimizer=optimizer, example_kwargs=batch, weights=directory,
                                    balance="parameters", **options)
            deployed = time.perf_counter() - start
            before = stage_bytes(cluster)
            start = time.perf_counter()
            loss = remote.train_step(batch, loss_output="loss", microbatches=args.microbatches, schedule="gpipe")
            memory = remote.memory()
            results[name] = {"deploy_s": deployed, "step_s": time.perf_counter() - start, "loss": loss,
                             "memory": memory, "between_stages": stage_bytes(cluster) - before}
            print(f"{name}: deploy {deployed:.0f} s, step {results[name]['step_s']:.0f} s, loss {loss:.4f}")
    report(parameters, written, client.peak, results)


def report(parameters: int, written: int, client_peak: int, results: dict) -> None:
    print(f"\nmodel: {parameters / 1e6:.0f}M parameters, {gib(written)} of float32 weights")
    print(f"client peak resident set over the three deploys and steps: {gib(client_peak)} "
          f"({client_peak / written:.2f}x the model)")
    print("\nfirst deployment (fp32, no recomputation), per stage: held = weights + gradients + optimizer + "
          "peak activations")
    for entry in results["fp32"]["memory"]:
        held = entry["weights"] + entry["gradients"] + entry["optimizer"] + entry["peak_activations"]
        print(f"  stage {entry['stage']}: weights {gib(entry['weights'])}, activations "
              f"{gib(entry['peak_activations'])}, held {gib(held)}, process peak {gib(entry['peak_process'])} "
              f"= {entry['peak_process'] / held:.2f}x held")
    never = {e["stage"]: e["peak_activations"] for e in results["fp32"]["memory"]}
    always = {e["stage"]: e["peak_activations"] for e in results["recompute"]["memory"]}
    print("\nactivations, recompute='never' / 'always': " +
          ", ".join(f"stage {s} {never[s] / max(always[s], 1):.1f}x" for s in sorted(never)))
    print(f"bytes between stages and the client in one step, fp32 / bf16: "
          f"{results['fp32']['between_stages'] / max(results['bf16']['between_stages'], 1):.2f}x "
          f"({gib(results['fp32']['between_stages'])} / {gib(results['bf16']['between_stages'])})")


if __name__ == "__main__":
    main()
