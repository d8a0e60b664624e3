"""Fixtures shared by test files."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: a second OpenMP thread only spins, and on a loaded 2-core machine that made the
    objective test files up to 40x slower. Restored after each test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
