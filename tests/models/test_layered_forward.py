"""The forward pass that holds one layer at a time (merit_core.models.layered_forward) measures what
the whole model measures: every probe statistic of every family's tiny model, from float32 and
bfloat16 files, single and sharded; it reads each stored tensor once per pass, frees what it read,
and `merit inspect` uses it."""

import pytest
import torch

from merit_core.checkpoint.resolve import SafetensorsReader, find_checkpoints
from merit_core.diagnostics import inspect_report as report
from merit_core.diagnostics.checkpoint_model import load_model
from merit_core.errors import CheckpointError, ConfigError
from merit_core.models import limits
from merit_core.models.attention_probe import ProbeResult, probe_attention
from merit_core.models.layered_forward import layered_model
from tests.models.family_models import FAMILIES, VOCAB, counted_reads, tiny_model

SEQ = 37  # longer than the tiny models' sliding window (8)


@pytest.fixture(scope="module")
def batch():
    """Two rows, the second padded at its start: masks, positions and padding all matter."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :5] = 0
    return ids, mask


def _saved(tmp_path, model_type: str, dtype: torch.dtype, **save):
    tiny_model(model_type, seed=5).to(dtype).save_pretrained(tmp_path / model_type, **save)
    return find_checkpoints(tmp_path / model_type)[0]


def _statistics(result: ProbeResult) -> dict[str, torch.Tensor]:
    """Every number a probe pass gives, by name."""
    assert result.entropy is not None and result.activations is not None and result.output is not None
    out = {
        "max_logits": result.max_logits,
        "scaling": torch.tensor(result.scaling),
        "input_max_l1": torch.tensor(result.input_max_l1),
        "input_max_l2": torch.tensor(result.input_max_l2),
        **{f"entropy_{k}": v for k, v in result.entropy.items()},
        "output": torch.tensor(
            [getattr(result.output, f) for f in ("max_abs_logit", "log_z_mean", "log_z_std", "log_z_max")]
        ),
    }
    for field in ("max_abs", "median_abs", "batch_index", "position", "dim"):
        out[f"activation_{field}"] = torch.tensor([getattr(a, field) for a in result.activations], dtype=torch.float64)
    return out


def _probe(ckpt, batch, layered: bool, **kw) -> dict[str, torch.Tensor]:
    ids, mask = batch
    model = load_model(ckpt, SafetensorsReader(ckpt), layered=layered, **kw)
    return _statistics(probe_attention(model, ids, mask, query_chunk=7, inputs=True, instability=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_layered_probe_equals_the_whole_model_probe(model_type, dtype, batch, tmp_path):
    """The layered model runs the family's own code on the same float32 weights (upcast from the
    file exactly as the whole-model loader upcasts them), in the same order: every statistic is
    the same float, so equality is asserted, stricter than any relative tolerance."""
    ckpt = _saved(tmp_path, model_type, dtype, max_shard_size=f"{15 * dtype.itemsize}KB")  # shards, an index
    assert len({entry[0] for entry in ckpt.tensors.values()}) > 1
    whole, layered = _probe(ckpt, batch, layered=False), _probe(ckpt, batch, layered=True)
    assert whole.keys() == layered.keys()
    for name in whole:
        assert torch.equal(whole[name].nan_to_num(), layered[name].nan_to_num()), name
    assert torch.isfinite(whole["max_logits"]).all() and whole["output"].abs().max() > 0


def test_read_ahead_gives_the_same_numbers(batch, tmp_path):
    """The read-ahead thread (on by default on CUDA) on the CPU: the same numbers."""
    ckpt = _saved(tmp_path, "llama", torch.bfloat16)
    ids, mask = batch
    config = load_model(ckpt, SafetensorsReader(ckpt), layered=True).config
    ahead = layered_model(config, SafetensorsReader(ckpt), prefetch=True)
    got = _statistics(probe_attention(ahead, ids, mask, inputs=True, instability=True))
    want = _statistics(
        probe_attention(load_model(ckpt, SafetensorsReader(ckpt)), ids, mask, inputs=True, instability=True)
    )
    for name in want:
        assert torch.equal(want[name].nan_to_num(), got[name].nan_to_num()), name


@pytest.mark.parametrize("model_type", ["gpt2", "gemma2"])  # tied output heads
def test_each_stored_tensor_is_read_once_and_freed(model_type, batch, tmp_path):
    ckpt = _saved(tmp_path, model_type, torch.bfloat16)
    config = load_model(ckpt, SafetensorsReader(ckpt), layered=True).config
    seen: list[tuple[str, list[str]]] = []
    model = layered_model(config, SafetensorsReader(ckpt), tap=lambda unit, weights: seen.append((unit, list(weights))))
    with torch.no_grad():
        model(input_ids=batch[0])
    read = [name for _, names in seen for name in names]
    tied = set(read) - {name for name in read if read.count(name) == 1}
    assert set(read) == set(ckpt.tensors)  # every stored tensor ...
    assert tied == {"model.embed_tokens.weight" if model_type == "gemma2" else "transformer.wte.weight"}
    # ... read once, but the embedding of a tied head: again for the head, rather than held throughout
    n_layers = config.num_hidden_layers if model_type == "gemma2" else config.n_layer
    layers = [unit for unit, _ in seen if ".layers." in unit or ".h." in unit]
    assert layers == [f"{'model.layers' if model_type == 'gemma2' else 'transformer.h'}.{i}" for i in range(n_layers)]
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing held after the pass


def test_missing_and_misshapen_weights_are_refused_before_reading(tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = _saved(tmp_path, "llama", torch.float32)
    weights = load_file(ckpt.path / "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}, ckpt.path / "model.safetensors"
    )
    short = find_checkpoints(ckpt.path, verify=False)[0]
    with pytest.raises(
        CheckpointError, match=r"lacks 1 weights the config needs, e\.g\. model\.layers\.1\.mlp\.up_proj"
    ):
        load_model(short, SafetensorsReader(short), layered=True)
    weights["model.norm.weight"] = torch.ones(7)
    save_file(weights, ckpt.path / "model.safetensors")
    bad = find_checkpoints(ckpt.path, verify=False)[0]
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight is \[7\], the config builds \[32\]"):
        load_model(bad, SafetensorsReader(bad), layered=True)


def test_inspect_probes_layer_by_layer_with_the_same_report(tmp_path, monkeypatch):
    """`merit inspect` of a checkpoint without optimizer state takes the layered path, reads each
    stored tensor once for the probe and the weight table, and its whole report equals the one the
    whole model gives (with the table from a pass of its own)."""
    ckpt = _saved(tmp_path, "qwen3", torch.bfloat16, max_shard_size="30KB")
    opts = report.InspectOptions(verify=False)
    assert report.probe_layered(ckpt, {}, opts)
    assert not report.probe_layered(ckpt, {}, report.InspectOptions(hessian=True))
    reads = counted_reads(monkeypatch)
    layered = report.inspect_paths([ckpt.path], opts).to_dict()
    attention = {
        n for n in ckpt.tensors if n.endswith(("q_proj.weight", "k_proj.weight", "q_norm.weight", "k_norm.weight"))
    }
    assert {n for n in reads if reads.count(n) > 1} == set()  # the max-norms and bounds use the probe's read
    assert set(reads) == set(ckpt.tensors)
    monkeypatch.setattr(report, "probe_layered", lambda *args: False)
    reads.clear()
    whole = report.inspect_paths([ckpt.path], opts).to_dict()
    assert {n for n in reads if reads.count(n) > 1} - attention  # the whole-model path reads every tensor twice
    assert layered == whole
    assert layered["checkpoints"][0]["weights"] and layered["checkpoints"][0]["layers"][0]["max_attention_logit"]


# A Llama-2-70B-shaped config: 80 layers of width 8192, MLP 28672, 8 key heads, 32000 tokens.
LLAMA_70B = dict(
    vocab_size=32000,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
)


def test_the_size_check_asks_one_layer_where_the_model_is_layered(monkeypatch):
    from transformers import LlamaConfig

    config = LlamaConfig(**LLAMA_70B)
    monkeypatch.setattr(limits, "available_host_memory", lambda: 24 * 2**30)
    with pytest.raises(ConfigError, match="too large: at least 49.9B parameters, 186 GiB for the weights alone"):
        limits.check_model_size(config, "llama-70b")
    layer = 8192 * 128 * (2 * 64 + 2 * 8) + 2 * 8192 * 28672  # the lower bound: no gate, no norms
    assert limits.check_layered_size(config, "llama-70b", seq_len=256) == 4 * layer + 4 * 256 * 32000
    monkeypatch.setattr(limits, "available_host_memory", lambda: 2 * 2**30)
    with pytest.raises(ConfigError, match="holding one layer at a time needs at least 2.3 GiB, more than the 2.0 GiB"):
        limits.check_layered_size(config, "llama-70b")


def test_upcasts_reuse_the_last_units_buffers_and_never_write_the_callers_tensors(batch, tmp_path):
    """Each layer's float32 weights are written into the buffers the layer before freed (one
    allocation for all layers of a shape), a second pass gives the same numbers as the first, and
    float32 tensors the caller hands in are used as they are, never written into."""
    ckpt = _saved(tmp_path, "llama", torch.bfloat16)
    ids, mask = batch
    config = load_model(ckpt, SafetensorsReader(ckpt), layered=True).config
    where: dict[str, set[int]] = {}
    tap = lambda unit, weights: where.__setitem__(unit, {w.data_ptr() for w in weights.values()})  # noqa: E731
    model = layered_model(config, SafetensorsReader(ckpt), tap=tap)
    first = _statistics(probe_attention(model, ids, mask, inputs=True, instability=True))
    layers = [ptrs for unit, ptrs in where.items() if ".layers." in unit]
    assert len(layers) == config.num_hidden_layers > 1 and all(ptrs == layers[0] for ptrs in layers)
    second = _statistics(probe_attention(model, ids, mask, inputs=True, instability=True))
    for name in first:
        assert torch.equal(first[name].nan_to_num(), second[name].nan_to_num()), name

    reader = SafetensorsReader(ckpt)
    own = {name: reader[name].float() for name in reader}
    kept = {name: t.clone() for name, t in own.items()}
    pointers = {t.data_ptr() for t in own.values()}
    where.clear()
    got = _statistics(probe_attention(layered_model(config, own, tap=tap), ids, mask, inputs=True, instability=True))
    assert set().union(*where.values()) <= pointers  # the caller's tensors themselves, no copies
    assert all(torch.equal(own[name], kept[name]) for name in own)
    for name in first:
        assert torch.equal(first[name].nan_to_num(), got[name].nan_to_num()), name
