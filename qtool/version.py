"""The version qtool reports and records in every checkpoint manifest (pyproject.toml declares the same)."""

__version__ = "0.1.0"
