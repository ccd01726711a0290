"""Test-wide setup: Triton's interpreter on CPU, a fixed seed, and no process group leaking between tests."""

import os

# Before anything imports triton: Triton kernel tests run the kernels in the interpreter without a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _destroy_process_group():  # noqa: ANN202
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
