"""Shared pytest configuration for the nvfp4_format tests: hypothesis profile and fixtures."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from reference import DISTRIBUTIONS, DTYPES

settings.register_profile(
    "nvfp4-format",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("nvfp4-format")


@pytest.fixture(params=sorted(DTYPES))
def dtype(request):
    """Each supported floating input dtype."""
    return DTYPES[request.param]


@pytest.fixture(params=DISTRIBUTIONS)
def dist(request):
    """Each named input distribution (see reference.sample)."""
    return request.param
