"""picker: an Envoy ext_proc endpoint picker for LLM inference (prefix-cache and load aware)."""

__version__ = "0.1.0"
