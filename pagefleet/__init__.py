"""pagefleet: LLM serving engine, router and operator.

The import packages live in top-level folders (engine/, router/, operator/),
mapped in pyproject.toml; this folder only anchors the `pagefleet` namespace.
"""

__version__ = "0.1.0"
