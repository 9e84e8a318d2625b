"""Benchmarks of berth: throughput against Hugging Face transformers, and the attention kernels."""
