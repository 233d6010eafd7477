"""Simulated ranks in one process: ``simulate`` and its attention mode."""
