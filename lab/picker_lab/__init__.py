"""The lab beside the picker: the vLLM simulator (`picker sim`), the benchmarks (`picker bench`), the demo
(`picker demo`), echo backends and the process supervisor the tests and benchmarks start things with.

It imports the product (`picker`); the product never imports it (its command line only names these commands'
modules). It ships as its own distribution, `llm-picker-lab` (lab/pyproject.toml), installed from a checkout by
`make install`: the `llm-picker` wheel holds what serves and nothing else.
"""
