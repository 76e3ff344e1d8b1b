"""Fixtures of the Python client tests: real ulyssesd processes on temporary unix sockets
(daemons.py starts them)."""
from __future__ import annotations

from typing import List

import pytest

from daemons import Cluster


@pytest.fixture(scope="session")
def sockets() -> List[str]:
    """Three daemons shared by the tests that only run calls (groups have unique names)."""
    c = Cluster()
    try:
        yield c.start(3)
    finally:
        c.close()


@pytest.fixture
def cluster() -> Cluster:
    """Daemons of this test alone (for daemon options such as a short call timeout)."""
    c = Cluster()
    try:
        yield c
    finally:
        c.close()
