"""Simulated vLLM fleet: an engine model in simulated time, vLLM's HTTP surface, metrics and KV events.

Modules: profiles (capacity and timing numbers), tokenizer, kvcache, engine (steppable scheduler), metrics,
kv_events (wire encoder + ZMQ publisher), openai_api (request/response shapes), driver (real time), server (aiohttp
pod), fleet (N pods in-process), cli (`picker sim`).
"""
