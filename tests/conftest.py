"""Test-wide setup: Triton's interpreter on CPU, a fixed seed, and no process group or rendezvous variable leaking
between tests."""

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


# Set in this process by Lightning's launchers (the main port of a fit that launched ranks) and by in-process fits:
# a later test's launch would inherit them and bind a port that may since have been taken.
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(autouse=True)
def _restore_rendezvous_variables():
    before = {name: os.environ.get(name) for name in _RENDEZVOUS}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
