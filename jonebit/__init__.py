"""jonebit: communication-compressed data-parallel training for JAX."""

__version__ = "0.1.0"
