"""The probe keeps no state outside its call: two probes in two threads on two models each get
exactly what probing that model alone gives; blocks nest; nothing is left on the model afterwards."""

import threading

import torch

from merit_core.models.attention_probe import (
    RECORDER_ATTRIBUTE,
    ProbeResult,
    probe_attention,
    record_attention_logits,
)
from tests.tiny_models import tiny_gpt2, tiny_llama

REPEATS = 5


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


def _same(a: ProbeResult, b: ProbeResult) -> bool:
    """Bit for bit: every tensor and number of the two results."""
    assert a.entropy is not None and b.entropy is not None
    return (
        torch.equal(a.max_logits, b.max_logits)
        and a.scaling == b.scaling
        and all(torch.equal(a.entropy[k], b.entropy[k]) for k in a.entropy)
        and a.activations == b.activations
        and a.output == b.output
    )


def test_two_probes_in_two_threads_on_two_models_each_get_their_own_result():
    models = {"gpt2": tiny_gpt2(seed=1).eval(), "llama": tiny_llama(seed=2).eval()}
    ids = {"gpt2": _ids(3), "llama": _ids(4)}
    alone = {name: probe_attention(m, ids[name], instability=True) for name, m in models.items()}
    assert alone["gpt2"].max_logits.shape != alone["llama"].max_logits.shape or not torch.equal(
        alone["gpt2"].max_logits, alone["llama"].max_logits
    )  # the two results tell the models apart
    start = threading.Barrier(2)
    got: dict[str, list[ProbeResult]] = {name: [] for name in models}
    errors: list[BaseException] = []

    def probe(name: str) -> None:
        try:
            for _ in range(REPEATS):
                start.wait(timeout=60)  # both threads enter their forward pass together
                got[name].append(probe_attention(models[name], ids[name], instability=True))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=probe, args=(name,)) for name in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    for name in models:
        assert len(got[name]) == REPEATS
        assert all(_same(result, alone[name]) for result in got[name]), name


def test_blocks_nest_and_leave_nothing_on_the_model():
    outer_model, inner_model = tiny_gpt2(seed=1).eval(), tiny_llama(seed=2).eval()
    ids = _ids(5)
    alone = probe_attention(outer_model, ids)
    before = outer_model.config._attn_implementation
    with torch.no_grad(), record_attention_logits(outer_model) as outer:
        other = probe_attention(inner_model, ids)  # another model's probe inside the block
        same = probe_attention(outer_model, ids)  # a nested probe of the same model: its own recorder
        outer_model(input_ids=ids, use_cache=False)
    assert torch.equal(outer.result(), alone.max_logits)  # one pass, of this model only
    assert torch.equal(same.max_logits, alone.max_logits)
    assert torch.equal(other.max_logits, probe_attention(inner_model, ids).max_logits)
    assert outer_model.config._attn_implementation == before
    for model in (outer_model, inner_model):
        assert not any(RECORDER_ATTRIBUTE in vars(m) for m in model.modules())


def test_a_forward_pass_outside_a_block_records_nothing():
    model = tiny_gpt2(seed=1).eval()
    with torch.no_grad(), record_attention_logits(model) as recorder:
        pass
    model(input_ids=_ids(6), use_cache=False)  # the attention implementation is the model's own again
    assert recorder.per_layer == {}


def test_layers_run_one_by_one_in_other_threads_record_into_the_blocks_recorder():
    """A layer-at-a-time probe: the decoder layers run one by one, each in a thread of its own, inside
    the block record what the whole forward pass records (GPT-2: no mask is causal attention)."""
    model = tiny_gpt2(seed=1).eval()
    ids = _ids(7)[:1]
    whole = probe_attention(model, ids)
    base = model.transformer
    with torch.no_grad(), record_attention_logits(model) as recorder:
        hidden = [base.wte(ids) + base.wpe(torch.arange(ids.shape[1])[None])]
        for block in base.h:

            def run(block=block) -> None:
                out = block(hidden[-1])
                hidden.append(out[0] if isinstance(out, tuple) else out)

            worker = threading.Thread(target=run)
            worker.start()
            worker.join()
    assert torch.equal(recorder.result(), whole.max_logits)
