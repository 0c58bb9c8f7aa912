"""Routing benchmark: the same seeded traces through every routing strategy, on the same simulated fleet.

`fast` mode steps simulated vLLM engines in-process (discrete events, no network); `live` mode drives a real
`picker sim` fleet through Envoy, the picker and peer routers. `picker bench --help` lists the options.
"""
