"""The serving assembly: `picker serve` (`server`) built from its config (`config`, `reference_flags`,
`policy`), its metrics and traces (`metrics`), TLS, and the Envoy config and supervisor.

May import every layer below it (`core` up to `extproc` and `api`); only the tools and the command line import it.
"""
