"""Test-wide setup: Triton's interpreter on CPU, a fixed seed, and no process group leaking between tests."""

import os

import torch

# Before anything imports triton: without a GPU, Triton kernel tests run the kernels in the interpreter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import random

import pytest


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _destroy_process_group():
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
