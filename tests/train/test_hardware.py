"""The one GPU peak-rate table (merit_core.train.hardware): every row is reachable by its GPU's name."""

from merit_core.train import hardware


def test_each_row_is_found_by_its_own_name():
    """First match wins: no shorter name (l4, a10, h100) may shadow a longer one listed after it."""
    for key, flops in hardware.BF16_PEAK_FLOPS:
        assert hardware.peak_bf16_flops(f"NVIDIA {key.upper()}") == flops, key
    assert hardware.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989e12  # SXM, as torch names it
    assert hardware.peak_bf16_flops("Tesla V100-SXM2-16GB") is None  # no bf16 tensor cores: no MFU
