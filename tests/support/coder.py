"""Whether the tests that need the converted Qwen2.5-Coder pair may run here."""

from __future__ import annotations

import os

import pytest

from uag.models import demo

FETCH = os.environ.get("UAG_TEST_CODER") == "1"

needs_coder_pair = pytest.mark.skipif(
    not (FETCH or all(demo.is_ready(name) for name in demo.CODER_MODELS)),
    reason="the coder pair is not converted: run make models-coder, or set UAG_TEST_CODER=1 to fetch it here",
)
