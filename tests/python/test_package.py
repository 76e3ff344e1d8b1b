"""The package as `pip install ./client/python` installs it."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import ulysses


@pytest.mark.skipif(not os.environ.get("ULYSSES_TEST_INSTALLED"),
                    reason="run from the source tree, not from an installed package")
def test_the_tests_run_the_installed_package():
    here = Path(ulysses.__file__).resolve().parent
    assert "site-packages" in str(here)
    assert (here / "py.typed").exists()


def test_the_library_matches_the_package():
    assert ulysses.library_version() == ulysses.__version__
    assert ulysses.ABI_VERSION >> 16 == 1
