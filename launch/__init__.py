"""The command-line launcher: ``python -m launch.main`` and ``python -m launch.local``."""
