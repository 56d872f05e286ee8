from __future__ import annotations

import pytest
from sim_helpers import ListWorkload


@pytest.fixture
def list_workload():
    return ListWorkload
