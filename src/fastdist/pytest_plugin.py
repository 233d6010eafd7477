"""pytest plugin (registered by installing fastdist): the ``fastdist_mesh`` fixture.

The fixture is a simulated :class:`~fastdist.Mesh`, ``{"dp": 2, "tp": 2}`` unless the test says
otherwise with ``@pytest.mark.fastdist_mesh(dp=1, sp=4)``::

    @pytest.mark.fastdist_mesh(tp=4)
    def test_my_layer(fastdist_mesh):
        out = fastdist.simulate(my_per_rank_fn, fastdist_mesh)(inputs)
"""

from __future__ import annotations

from typing import Any

import pytest

from .mesh import Mesh

__all__ = ["fastdist_mesh"]


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "fastdist_mesh(**axes): axes of the simulated mesh given by the fastdist_mesh fixture (default dp=2, tp=2)")


@pytest.fixture
def fastdist_mesh(request: Any) -> Mesh:
    """A simulated mesh; axes from ``@pytest.mark.fastdist_mesh(...)``, default ``{"dp": 2, "tp": 2}``."""
    marker = request.node.get_closest_marker("fastdist_mesh")
    return Mesh(dict(marker.kwargs) if marker and marker.kwargs else {"dp": 2, "tp": 2})
