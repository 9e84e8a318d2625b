"""Structured outputs: a request's grammar compiled (in processes stopped at their deadline, fair by
tenant) and matched a token at a time, as vLLM's ``v1/structured_output``."""
