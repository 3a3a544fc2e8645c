"""Fixtures of the image tests (image_support.py has their helpers)."""

from __future__ import annotations

import pytest

from .image_support import buildah


@pytest.fixture
def container(image):
    """A working container of the module's `image` fixture, removed after the test."""
    name = buildah("from", "--pull=false", image)
    yield name
    buildah("rm", name)
