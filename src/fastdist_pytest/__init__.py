"""pytest plugin of fastdist (registered by installing it): the ``fastdist_mesh`` fixture.

This is its own small top-level package so that every pytest run in an environment where
fastdist is installed stays cheap: importing it imports neither torch nor fastdist. Only a
test that asks for the fixture pays for them.

The fixture is a simulated :class:`fastdist.Mesh`, ``{"dp": 2, "tp": 2}`` unless the test says
otherwise with ``@pytest.mark.fastdist_mesh(dp=1, sp=4)``::

    @pytest.mark.fastdist_mesh(tp=4)
    def test_my_layer(fastdist_mesh):
        out = fastdist.simulate(my_per_rank_fn, fastdist_mesh)(inputs)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from fastdist import Mesh

__all__ = ["fastdist_mesh", "pytest_configure"]

MARKER = (
    "fastdist_mesh(**axes): axes of the simulated mesh given by the fastdist_mesh fixture "
    "(default dp=2, tp=2)"
)


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", MARKER)


@pytest.fixture
def fastdist_mesh(request: Any) -> Mesh:
    """A simulated mesh; axes from ``@pytest.mark.fastdist_mesh(...)``, default
    ``{"dp": 2, "tp": 2}``."""
    # Imported here, not at module level: pytest loads this plugin in every run.
    from fastdist import Mesh

    marker = request.node.get_closest_marker("fastdist_mesh")
    return Mesh(dict(marker.kwargs) if marker and marker.kwargs else {"dp": 2, "tp": 2})
