"""MERIT's backends on a CUDA GPU at the sizes of real models (`pytest -m gpu` on a GPU machine).

- The Triton backend against the reference backend on the parameter shapes of GPT-2 small and
  Llama-3.2-1B (one transformer block each, with the embeddings), fp32 and bf16 parameters. The
  embeddings are tall matrices of many finalize chunks of row tiles (50257 and 128256 rows), so
  their column maxima are combined across programs by atomic max; a gradient spike in the last
  rows puts the maxima in the last chunk.
- A tensor of more than 2**31 elements (64-bit offsets), with identical rows so that a two-row
  reference gives every row's answer.
- The NaN/Inf table (tests/optim/nonfinite.py) on CUDA for every backend that runs there.

Every test is marked `gpu` and skips with its reason where CUDA is absent.
"""

from __future__ import annotations

import pytest
import torch

from merit_core.optim.merit.common import Hyper
from tests.optim.nonfinite import BASE, CASES, CONFIGS, check

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)"),
]

# GPT-2 small (HF Conv1D layout [in, out]): wte, wpe, one block, ln_f
GPT2_SMALL = [(50257, 768), (1024, 768), (768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
GPT2_SMALL += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,), (768,), (768,)]
# Llama-3.2-1B (nn.Linear [out, in]): embed_tokens (tied head), one layer with GQA k/v, norm
LLAMA_32_1B = [(128256, 2048), (2048, 2048), (512, 2048), (512, 2048), (2048, 2048)]
LLAMA_32_1B += [(8192, 2048), (8192, 2048), (2048, 8192), (2048,), (2048,), (2048,)]


def _backend(name):
    from merit_core.optim.merit.functional import BACKENDS

    return BACKENDS[name].load()


def _tensors(shapes, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = [(0.2 * torch.randn(s, generator=gen, device="cuda")).to(dtype) for s in shapes]
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, device="cuda")
        if g.dim() == 2:
            g[-1] *= 50  # each column's maximum in the last row tile: the last finalize chunk
        grads.append(g.to(dtype))
    return params, grads


def _one_ulp_or_less(got, want) -> bool:
    bits = {torch.bfloat16: 7, torch.float16: 10}[want.dtype]
    exponent = torch.frexp(want.float().abs()).exponent.float()
    ulp = torch.where(want == 0, torch.full_like(exponent, 2.0**-133), torch.exp2(exponent - 1 - bits))
    return bool(((got.float() - want.float()).abs() <= ulp).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shapes", [GPT2_SMALL, LLAMA_32_1B], ids=["gpt2-small", "llama-3.2-1b"])
def test_triton_matches_the_reference_at_real_shapes(shapes, dtype):
    from merit_core.optim.merit.triton.plan import DEFAULT_TILING

    chunk_rows = DEFAULT_TILING.rows * DEFAULT_TILING.fin_row_tiles
    assert shapes[0][0] > 8 * chunk_rows  # the embedding spans many row-tile chunks
    triton, reference = _backend("triton"), _backend("reference")
    params, _ = _tensors(shapes, dtype, 0)
    ref = [p.clone() for p in params]
    m, v = [torch.zeros(p.shape, device="cuda") for p in params], [torch.zeros(p.shape, device="cuda") for p in params]
    m_ref, v_ref = [x.clone() for x in m], [x.clone() for x in v]
    steps = [torch.tensor(0.0) for _ in params]
    for k, kw in enumerate([{}, dict(weight_decay=0.01), dict(bias_correction=True)]):
        h = Hyper.of(**{**BASE, **kw})
        _, grads = _tensors(shapes, dtype, k + 1)
        torch._foreach_add_(steps, 1)
        triton(params, grads, m, v, steps, h)
        reference(ref, grads, m_ref, v_ref, steps, h)
        for n, (got, want) in enumerate(zip(params, ref)):
            where = f"step {k + 1}, tensor {n} {tuple(got.shape)}"
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda e, w=where: f"{w}: {e}")
            else:
                assert _one_ulp_or_less(got, want), where
                want.copy_(got)  # one ulp may flip the next step's rounding: compare each step afresh
            torch.testing.assert_close(m[n], m_ref[n], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(v[n], v_ref[n], rtol=1e-6, atol=1e-9)


def test_triton_on_a_tensor_of_more_than_2_to_the_31_elements():
    free, _ = torch.cuda.mem_get_info()
    cols = 2048
    rows = (1 << 31) // cols + 64  # 64 rows past the 2**31-th element
    if free < 6 * rows * cols * 4 + (4 << 30):
        pytest.skip(f"needs ~{6 * rows * cols * 4 / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    triton, reference = _backend("triton"), _backend("reference")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_row = 0.2 * torch.randn(1, cols, generator=gen, device="cuda")
    g_row = torch.randn(1, cols, generator=gen, device="cuda")
    h = Hyper.of(**BASE)
    small = [w_row.expand(2, cols).clone()]
    reference(small, [g_row.expand(2, cols).clone()], [torch.zeros(2, cols, device="cuda")],
              [torch.zeros(2, cols, device="cuda")], [torch.tensor(1.0)], h)  # fmt: skip
    big = [w_row.expand(rows, cols).contiguous()]
    grad = [g_row.expand(rows, cols).contiguous()]
    m, v = [torch.zeros(rows, cols, device="cuda")], [torch.zeros(rows, cols, device="cuda")]
    assert big[0].numel() > 2**31
    triton(big, grad, m, v, [torch.tensor(1.0)], h)
    del grad
    want = small[0][0]
    for row in (0, rows // 2, (1 << 31) // cols - 1, (1 << 31) // cols, rows - 1):  # both sides of 2**31
        torch.testing.assert_close(big[0][row], want, rtol=1e-6, atol=1e-6, msg=lambda e, r=row: f"row {r}: {e}")
    assert bool((big[0] == big[0][:1]).all())  # every row the same, as the reference says


# every backend that runs on CUDA; the compile backend on the default config (each config compiles anew)
CUDA_CASES = [(name, config) for name in ("reference", "foreach", "triton") for config in CONFIGS]
CUDA_CASES.append(("compile", "default"))


@pytest.mark.parametrize("name, config", CUDA_CASES)
def test_nonfinite_table_on_cuda(name, config):
    """One meaning of NaN and infinity on the device: every case of the table."""
    step = _backend(name)
    for case in CASES:
        check(step, case, config, device="cuda")
