"""The mmserver benchmark: `scripts/bench` (see `python -m benchlib --help`)."""
