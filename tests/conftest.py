"""Shared fixtures and device markers.

* ``@pytest.mark.cuda`` / ``@pytest.mark.xpu`` tests skip cleanly where that device is absent.
* ``DSV4_TEST_COMPILE=1`` re-runs the op tests that call ops through :func:`call` under
  ``torch.compile(fullgraph=True)`` — one switch that catches whole classes of trace bugs.
"""

from __future__ import annotations

import os

import pytest
import torch

import dsv4_compile  # noqa: F401  (registers the ops)

COMPILE = os.environ.get("DSV4_TEST_COMPILE", "0") == "1"


def pytest_collection_modifyitems(config, items):
    has = {
        "cuda": torch.cuda.is_available(),
        "xpu": hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    for item in items:
        for device, present in has.items():
            if device in item.keywords and not present:
                item.add_marker(pytest.mark.skip(reason=f"needs a {device.upper()} device"))


def call(fn, *args, **kwargs):
    """Call ``fn`` eagerly, or compiled with ``fullgraph=True`` when ``DSV4_TEST_COMPILE=1``."""
    if COMPILE:
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, dynamic=False)(*args, **kwargs)
    return fn(*args, **kwargs)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
