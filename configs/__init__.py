"""Job configs for ``python -m launch.main --config=configs/NAME.py[:ARG]``."""
