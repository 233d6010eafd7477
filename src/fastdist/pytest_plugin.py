"""The pytest plugin's fixture, importable from fastdist too: see :mod:`fastdist_pytest`.

pytest loads the plugin from the top-level package ``fastdist_pytest`` (its entry point), which
imports neither torch nor fastdist; this module re-exports it for ``-p fastdist.pytest_plugin``
users of earlier versions.
"""

from __future__ import annotations

from fastdist_pytest import fastdist_mesh, pytest_configure

__all__ = ["fastdist_mesh", "pytest_configure"]
