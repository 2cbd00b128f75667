"""Time and peak memory of `merit inspect`'s weight statistics on paper-sized checkpoints.

Writes random GPT-2 small (124M) and Llama-130M checkpoints with safetensors directly (no model
is built), then measures, each in a fresh process so peak RSS is its own:
- baseline: `safetensors.torch.load_file` of the whole file, then the same statistics on the dict;
- lazy: `weight_stats(path)`, one tensor at a time through `safe_open`;
- cli: `merit inspect PATH --no-logits` end to end (imports and rendering included).
The files were just written, so they are in the page cache (a warm read).

With `--probe`: the probe forward pass alone (no files), max attention logits only (`probe_attention`
as before) against the same pass measuring attention entropy, residual-stream activations and log Z
too (`instability=True`), on GPT-2 small and Llama-130M at inspect's default 256 tokens and on
gpt2-tiny at `merit train`'s default eval batch (16 x 128); for the latter also a training step
(forward, backward, MERIT step, batch 16 x 128) so that the overhead at the default eval cadence
(one probe per 50 steps) is a fraction of training time.

    /work/venv/bin/python benchmarks/inspect_speed.py [--keep DIR]
    /work/venv/bin/python benchmarks/inspect_speed.py --probe [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

CHILD = r"""
import json, sys, time
mode, path = sys.argv[1], sys.argv[2]
import torch
from merit_core.diagnostics.weights import attention_weight_stats, weight_stats
def status_mib(key):  # VmHWM is this process image's peak RSS (ru_maxrss survives exec from the parent)
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith(key)) / 1024
base = status_mib("VmRSS")
t0 = time.perf_counter()
if mode == "baseline":
    from safetensors.torch import load_file
    tensors = load_file(path + "/model.safetensors")
    stats = attention_weight_stats(tensors, json.load(open(path + "/config.json")))
else:
    stats = weight_stats(path)
elapsed = time.perf_counter() - t0
peak = status_mib("VmHWM")
print(json.dumps({"seconds": elapsed, "peak_mib": peak, "base_mib": base, "layers": len(stats.layers),
                  "k_max": max(l.k_max_norm for l in stats.layers)}))
"""


def gpt2_small_shapes() -> dict[str, tuple[int, ...]]:
    d, n_layer, vocab, ctx = 768, 12, 50257, 1024
    shapes = {
        "transformer.wte.weight": (vocab, d),
        "transformer.wpe.weight": (ctx, d),
        "transformer.ln_f.weight": (d,),
        "transformer.ln_f.bias": (d,),
    }
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (d,),
                p + "ln_1.bias": (d,),
                p + "ln_2.weight": (d,),
                p + "ln_2.bias": (d,),
                p + "attn.c_attn.weight": (d, 3 * d),
                p + "attn.c_attn.bias": (3 * d,),
                p + "attn.c_proj.weight": (d, d),
                p + "attn.c_proj.bias": (d,),
                p + "mlp.c_fc.weight": (d, 4 * d),
                p + "mlp.c_fc.bias": (4 * d,),
                p + "mlp.c_proj.weight": (4 * d, d),
                p + "mlp.c_proj.bias": (d,),
            }
        )
    return shapes


def llama_130m_shapes() -> dict[str, tuple[int, ...]]:
    d, n_layer, vocab, ff = 768, 12, 32000, 2048
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                **{p + f"self_attn.{n}_proj.weight": (d, d) for n in "qkvo"},
                p + "mlp.gate_proj.weight": (ff, d),
                p + "mlp.up_proj.weight": (ff, d),
                p + "mlp.down_proj.weight": (d, ff),
            }
        )
    return shapes


def write_checkpoint(folder: Path, family: str) -> tuple[int, int]:
    """Random weights and a config.json; returns (parameters, bytes)."""
    import torch
    from safetensors.torch import save_file

    from merit_core.models import model_config

    folder.mkdir(parents=True, exist_ok=True)
    shapes = gpt2_small_shapes() if family == "gpt2" else llama_130m_shapes()
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in shapes.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model_config("gpt2-small" if family == "gpt2" else "llama-130m")
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return sum(t.numel() for t in tensors.values()), (folder / "model.safetensors").stat().st_size


def run_child(mode: str, path: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(path)], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def torch_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def run_cli(path: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "merit_cli", "inspect", str(path), "--no-logits", "--no-weights"],
        capture_output=True,
        env=env,
        check=True,
        cwd=ROOT,
    )
    return time.perf_counter() - t0


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _paired_medians(a, b, repeats: int) -> tuple[float, float]:
    """Median seconds of `a` and of `b`, timed in alternation so that a change of load hits both."""
    a(), b()  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        for fn, times in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(ta)[repeats // 2], sorted(tb)[repeats // 2]


PROBE_CASES = (("gpt2-small", 1, 256), ("llama-130m", 1, 256), ("gpt2-tiny", 16, 128))


def _probe_row(name: str, batch: int, seq: int, repeats: int) -> tuple:
    """(name, batch, seq, probe s, probe + instability s, training step s or None)."""
    import torch

    from merit_core.models import build_model, model_config
    from merit_core.models.attention_probe import probe_attention
    from merit_core.optim import build_optimizer

    config = model_config(name)
    model = build_model(config, seed=0).eval()
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    old, new = _paired_medians(
        lambda: probe_attention(model, ids), lambda: probe_attention(model, ids, instability=True), repeats
    )
    if name != "gpt2-tiny":
        return name, batch, seq, old, new, None
    model.train()  # `merit train`'s default model, batch and optimizer
    opt = build_optimizer("merit", model)

    def train_step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return name, batch, seq, old, new, _median_seconds(train_step, repeats)


def probe_cost(repeats: int, eval_every: int = 50) -> None:
    """The probe with and without the instability statistics, and a training step for scale."""
    import torch

    rows = [_probe_row(name, batch, seq, repeats) for name, batch, seq in PROBE_CASES]
    print(
        f"{'model':<12} {'tokens':>8} {'probe s':>8} {'+ instability s':>16} {'extra':>7}  training (1 probe / {eval_every} steps)"
    )
    for name, batch, seq, old, new, step in rows:
        extra = f"{100 * (new - old) / old:>6.0f}%"
        line = f"{name:<12} {f'{batch}x{seq}':>8} {old:>8.3f} {new:>16.3f} {extra}"
        if step is not None:
            window = eval_every * step
            line += (
                f"  step {step:.3f} s; the probe {100 * new / window:.2f}% of {eval_every} steps, "
                f"the new statistics {100 * (new - old) / window:.2f}%"
            )
        print(line)
    print(f"median of {repeats} runs; {torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="write the checkpoints here and keep them")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (the median is shown)")
    parser.add_argument("--threads", type=int, default=torch_threads(), help="intra-op threads [default: cores]")
    parser.add_argument("--probe", action="store_true", help="time the probe pass with and without the new statistics")
    args = parser.parse_args()
    if args.probe:
        import torch

        torch.set_num_threads(args.threads)
        probe_cost(args.repeats)
        return
    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="merit-inspect-bench-")
    root = args.keep or Path(tmp.name)
    rows = []
    for family, name in (("gpt2", "GPT-2 small"), ("llama", "Llama-130M")):
        folder = root / family
        t0 = time.perf_counter()
        n_params, n_bytes = write_checkpoint(folder, family)
        print(
            f"{name}: {n_params / 1e6:.1f}M params, {n_bytes / 2**20:.0f} MiB file, written in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        results = {}
        for mode, threads in (("baseline", args.threads), ("lazy", args.threads), ("lazy", 1)):
            runs = sorted((run_child(mode, folder, threads) for _ in range(args.repeats)), key=lambda r: r["seconds"])
            results[(mode, threads)] = runs[len(runs) // 2]
        assert results[("baseline", args.threads)]["k_max"] == results[("lazy", args.threads)]["k_max"]
        cli = sorted(run_cli(folder) for _ in range(args.repeats))[args.repeats // 2]
        rows.append((name, n_bytes, results, cli))
    t = args.threads
    print()
    print(
        f"{'checkpoint':<12} {'method':<28} {'time s':>7} {'x base':>7} {'peak RSS MiB':>13} "
        f"{'above import':>13} {'x base':>7}"
    )
    for name, _n_bytes, res, cli in rows:
        base = res[("baseline", t)]
        above_base = base["peak_mib"] - base["base_mib"]
        for label, key in (
            (f"load_file + stats ({t} thr)", ("baseline", t)),
            (f"weight_stats lazy ({t} thr)", ("lazy", t)),
            ("weight_stats lazy (1 thr)", ("lazy", 1)),
        ):
            r = res[key]
            above = r["peak_mib"] - r["base_mib"]
            print(
                f"{name:<12} {label:<28} {r['seconds']:>7.2f} {r['seconds'] / base['seconds']:>7.2f} "
                f"{r['peak_mib']:>13.0f} {above:>13.0f} {above / above_base:>7.2f}"
            )
        print(f"{name:<12} {'merit inspect --no-logits':<28} {cli:>7.2f}   (end to end, imports and rendering)")
    print(
        "\nfile sizes: "
        + ", ".join(f"{n}: {s / 2**20:.0f} MiB" for n, s, _, _ in rows)
        + f"; median of {args.repeats} runs; load average at the end: {os.getloadavg()[0]:.1f}"
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
