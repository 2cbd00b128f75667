"""`merit inspect` of a Llama-shaped bf16 sharded checkpoint larger than a float32 copy in memory would
allow: its peak resident memory and wall time beside the floor measured in the same run.

Writes a checkpoint of random bf16 weights (shards of at most 2 GiB, with the index transformers
writes, no tokenizer: the probe then uses 256 seeded token ids) into `--dir`, then:
- reads its files once (the read bandwidth; this also leaves them in the page cache, as they are
  for the run that follows) and times fp32 matrix products of the probe's shapes (256 tokens x
  the model's width), before the run and again after it (a shared machine's load changes);
- runs `merit inspect DIR --json` in a child process: its wall time, CPU time and peak RSS (VmHWM).
The floor is the bytes of the files at the measured read bandwidth plus the probe's FLOPs (2 x
parameters x tokens for the projections, 4 x layers x tokens^2 x width for the attention) at the
measured matmul throughput. The load average (1, 5, 15 min) before and after is printed with the
figures: on a shared machine the run competes with others.

`--against TREE` times `merit inspect` of another checkout too (the code before a change), the
two alternating `--rounds` times on the same checkpoint, so that a loaded machine's drift falls on
both alike; it prints one row per run and how far the two reports' numbers differ. `--reuse` takes
the checkpoint a `--keep` run left in `--dir` instead of writing one (and leaves it there).

    python benchmarks/inspect_large.py --dir /tmp/llama-1b --size 1b
    python benchmarks/inspect_large.py --dir /big/disk/llama-7b --size 7b --budget 900 [--keep]
    python benchmarks/inspect_large.py --dir /tmp/llama-1b --size 1b --reuse --against /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

# (layers, width, MLP width, heads, key heads, vocabulary): TinyLlama-1.1B, Llama-2-7B, Llama-2-70B
SHAPES = {
    "1b": (22, 2048, 5632, 32, 4, 32000),
    "7b": (32, 4096, 11008, 32, 32, 32000),
    "70b": (80, 8192, 28672, 64, 8, 32000),
}
SHARD_BYTES = 2 * 2**30
TOKENS = 256  # inspect's default probe length


def llama_config(size: str) -> dict:
    layers, d, ff, heads, kv, vocab = SHAPES[size]
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": d,
        "intermediate_size": ff,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d // heads,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }


def llama_shapes(size: str) -> dict[str, tuple[int, ...]]:
    layers, d, ff, heads, kv, vocab = SHAPES[size]
    hd = d // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (heads * hd, d),
                p + "self_attn.k_proj.weight": (kv * hd, d),
                p + "self_attn.v_proj.weight": (kv * hd, d),
                p + "self_attn.o_proj.weight": (d, heads * hd),
                p + "post_attention_layernorm.weight": (d,),
                p + "mlp.gate_proj.weight": (ff, d),
                p + "mlp.up_proj.weight": (ff, d),
                p + "mlp.down_proj.weight": (d, ff),
            }
        )
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    return shapes


def write_checkpoint(folder: Path, size: str) -> tuple[int, int, int]:
    """Random bf16 weights in shards with an index, and config.json; (parameters, bytes, shards)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shapes = llama_shapes(size)
    gen = torch.Generator().manual_seed(0)
    groups: list[list[str]] = [[]]
    filled = 0
    for name, shape in shapes.items():
        nbytes = 2 * _numel(shape)
        if groups[-1] and filled + nbytes > SHARD_BYTES:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += nbytes
    weight_map = {}
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in names:
            shape = shapes[name]
            if len(shape) == 1:
                shard[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                std = shape[1] ** -0.5
                shard[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
            weight_map[name] = file
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        del shard
    params = sum(_numel(s) for s in shapes.values())
    index = {"metadata": {"total_size": 2 * params}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps(llama_config(size), indent=1))
    return params, sum(f.stat().st_size for f in folder.glob("*.safetensors")), len(groups)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_bandwidth(folder: Path) -> tuple[float, int]:
    """(bytes per second, bytes) of one sequential read of the checkpoint's files."""
    buf = bytearray(64 * 2**20)
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as fh:
            while n := fh.readinto(view):
                total += n
    return total / (time.perf_counter() - t0), total


def matmul_flops(width: int, ff: int, seconds: float = 3.0) -> float:
    """fp32 FLOP/s of the probe's products: [256, width] x [width, ff] and back, best of repeats."""
    import torch

    x = torch.randn(TOKENS, width)
    w1, w2 = torch.randn(width, ff), torch.randn(ff, width)
    flops = 2 * 2 * TOKENS * width * ff
    best = float("inf")
    end = time.perf_counter() + seconds
    x @ w1  # warm-up
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        (x @ w1) @ w2
        best = min(best, time.perf_counter() - t0)
    return flops / best


def measure_floor(folder: Path, size: str, params: int, nbytes: int) -> tuple[float, float, float]:
    """(floor seconds, read bytes/s, fp32 matmul FLOP/s) measured now."""
    _, d, ff, *_ = SHAPES[size]
    bandwidth, flops = read_bandwidth(folder)[0], matmul_flops(d, ff)
    return nbytes / bandwidth + probe_flops(size, params) / flops, bandwidth, flops


def probe_flops(size: str, params: int) -> float:
    layers, d, *_ = SHAPES[size]
    return 2 * params * TOKENS + 4 * layers * TOKENS**2 * d


# Runs `merit` (argv[2:]) and writes its peak RSS (VmHWM, KiB) to argv[1] at exit. VmHWM is this
# process image's own: ru_maxrss of a child starts at its parent's peak (here: a shard being written).
LAUNCH = r"""
import atexit, runpy, sys
out = sys.argv.pop(1)
def peak():
    with open("/proc/self/status") as fh:
        hwm = next(line for line in fh if line.startswith("VmHWM"))
    with open(out, "w") as fh:
        fh.write(hwm.split()[1])
atexit.register(peak)
sys.argv[0] = "merit"
runpy.run_module("merit_cli", run_name="__main__", alter_sys=True)
"""


def run_inspect(folder: Path, budget: float, tree: Path = ROOT, name: str = "inspect") -> tuple[float, float, int]:
    """(wall seconds, peak RSS bytes, exit status) of `merit inspect FOLDER --json` of the checkout
    `tree` in a child process (its report: FOLDER/NAME.json), killed after `budget` seconds (status
    -9; its peak RSS is then unknown: NaN)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    peak_file = folder / "peak_rss_kib"
    peak_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", LAUNCH, str(peak_file), "inspect", str(folder), "--json", str(folder / f"{name}.json")]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=budget)
        status = done.returncode
    except subprocess.TimeoutExpired:
        status = -9
    wall = time.perf_counter() - t0
    if status not in (0, -9):
        err = done.stderr.strip().splitlines()
        print(f"merit inspect exited {status}: {err[-1] if err else ''}", file=sys.stderr)
    peak = int(peak_file.read_text()) * 1024 if peak_file.is_file() else float("nan")
    return wall, peak, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, type=Path, help="folder to write the checkpoint into (created)")
    parser.add_argument("--size", choices=sorted(SHAPES), default="7b", help="Llama shape (default 7b)")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds `merit inspect` may run (killed after)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint (default: delete what was written)")
    parser.add_argument("--reuse", action="store_true", help="take the checkpoint a --keep run left in --dir")
    parser.add_argument("--against", type=Path, help="another checkout, timed alternately on the same checkpoint")
    parser.add_argument("--rounds", type=int, default=1, help="with --against: runs of each checkout")
    args = parser.parse_args()
    if args.reuse:
        if not (args.dir / "config.json").is_file() or json.loads(
            (args.dir / "config.json").read_text()
        ) != llama_config(args.size):
            sys.exit(f"{args.dir} holds no {args.size} checkpoint of this script (write one with --keep)")
    elif args.dir.exists() and any(args.dir.iterdir()):
        sys.exit(f"{args.dir} is not empty: give a new folder (the checkpoint is written there, then deleted)")
    trees = [("this checkout", ROOT)] + ([("--against", args.against.resolve())] if args.against else [])
    load_before = os.getloadavg()
    try:
        t0 = time.perf_counter()
        if args.reuse:
            params, nbytes, shards = _written(args.dir, args.size)
        else:
            params, nbytes, shards = write_checkpoint(args.dir, args.size)
        written = time.perf_counter() - t0
        floors = []  # (floor seconds, read bytes/s, matmul FLOP/s): before and after the runs
        floors.append(measure_floor(args.dir, args.size, params, nbytes))
        runs = []  # (which checkout, wall, peak, status, cpu)
        for i in range(args.rounds if args.against else 1):
            for label, tree in trees if i % 2 == 0 else trees[::-1]:  # alternating, each first in turn
                cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                wall, peak, status = run_inspect(args.dir, args.budget, tree, f"inspect-{trees.index((label, tree))}")
                cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                runs.append((label, wall, peak, status, cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime))
        floors.append(measure_floor(args.dir, args.size, params, nbytes))
        differ = _report_difference(args.dir) if args.against else None
    finally:
        if not args.keep and not args.reuse:
            shutil.rmtree(args.dir, ignore_errors=True)
    load_after = os.getloadavg()
    cores = os.cpu_count()
    print(
        f"checkpoint {'reused' if args.reuse else f'written in {written:.0f} s'}; {cores} cores; load average before "
        f"{' '.join(f'{x:.1f}' for x in load_before)}, after {' '.join(f'{x:.1f}' for x in load_after)}"
    )
    print()
    print(
        "| shape | parameters | bf16 files | read GiB/s | fp32 GFLOP/s | floor | `merit inspect` | its CPU time "
        "| x floor | peak RSS |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    (f0, b0, p0), (f1, b1, p1) = floors
    for label, wall, peak, status, cpu in runs:
        done = "" if status == 0 else (" (killed at the budget)" if status == -9 else f" (exit {status})")
        shape = args.size if len(trees) == 1 else f"{args.size}, {label}"
        print(
            f"| {shape} | {params / 1e9:.2f}B | {nbytes / 2**30:.2f} GiB in {shards} "
            f"| {b0 / 2**30:.2f} / {b1 / 2**30:.2f} | {p0 / 1e9:.0f} / {p1 / 1e9:.0f} | {f0:.1f} / {f1:.1f} s "
            f"| {wall:.1f} s{done} | {cpu:.1f} s | {wall / f0:.1f}x / {wall / f1:.1f}x | {peak / 2**30:.2f} GiB |"
        )
    print("(read bandwidth, matmul throughput, floor and x floor: measured before / after the runs; runs in order)")
    if differ is not None:
        print(f"the two checkouts' reports: {differ}")


def _written(folder: Path, size: str) -> tuple[int, int, int]:
    """(parameters, bytes, shards) of the checkpoint `write_checkpoint` left in `folder`."""
    files = sorted(folder.glob("*.safetensors"))
    return sum(_numel(s) for s in llama_shapes(size).values()), sum(f.stat().st_size for f in files), len(files)


def _report_difference(folder: Path) -> str:
    """How far the numbers of the two checkouts' reports differ (the largest relative difference)."""
    reports = [folder / "inspect-0.json", folder / "inspect-1.json"]
    if not all(r.is_file() for r in reports):
        return "not both written"
    worst = [0.0, ""]

    def walk(a, b, key: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in a.keys() | b.keys():
                walk(a.get(k), b.get(k), k)
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for x, y in zip(a, b):
                walk(x, y, key)
        elif isinstance(a, float) and isinstance(b, float) and a != b:
            rel = abs(a - b) / max(abs(a), abs(b))
            if rel > worst[0]:
                worst[:] = [rel, key]
        elif a != b and not (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b):
            worst[:] = [float("inf"), key]

    first, second = (json.loads(r.read_text()) for r in reports)
    walk(first, second, "")
    if worst[0] == 0:
        return "identical"
    return f"largest relative difference {worst[0]:.2g} ({worst[1]})"


if __name__ == "__main__":
    main()
