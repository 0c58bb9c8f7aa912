"""The vocabulary every layer shares: a request and its errors (`requests`), config decoding (`schema`), model
rewrite rules, and small helpers (retries, task life cycles, logging, memory, metric twins).

Imports nothing else of picker: everything may import it.
"""
