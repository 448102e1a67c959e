"""mmserver: a multi-model server for scikit-learn models."""

__version__ = "0.1.0"
