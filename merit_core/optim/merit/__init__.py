"""MERIT, laid out like ``torch/optim/adam.py``: the optimizer class collects each param group's
tensors (``optimizer.py``) and calls one functional step (``functional.py``), which hands them to
one backend with the same signature for all (the tensor lists and one hyperparameter record):

- ``reference.py``  the readable single-tensor transcription every test compares against
- ``foreach.py``    eager multi-tensor torch ops (GPUs without Triton, MPS, XPU)
- ``cpu.py``        the C++/OpenMP kernel (``csrc/merit_cpu.cpp``) as a torch custom op
- ``compiled.py``   torch.compile of two passes per tensor (opt-in)
- ``triton/``       grouped Triton kernels (the CUDA default when triton imports)
- ``dtensor_step.py`` DTensor/FSDP2: a backend's passes on each local shard + one all-reduce

``common.py`` holds what they share: the hyperparameter record, the rule for NaN and infinities
and the norm helpers.
"""

from merit_core.optim.merit.functional import BACKENDS, IMPLEMENTATIONS, merit
from merit_core.optim.merit.optimizer import MERIT

__all__ = ["MERIT", "merit", "BACKENDS", "IMPLEMENTATIONS"]
