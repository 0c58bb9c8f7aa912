"""Scheduling: filters, scorers and pickers that turn (request, endpoints, index, clock) into a ranked list."""
