"""Endpoint state: the pool of model-server pods, their scraped metrics and our own in-flight counts."""

from picker.endpoints.state import Endpoint, EndpointMetrics, parse_address

__all__ = ["Endpoint", "EndpointMetrics", "parse_address"]
