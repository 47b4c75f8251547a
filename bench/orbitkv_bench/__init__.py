"""Benchmarks that print JSON ratios measured side by side in one run (``orbitkv bench ...``)."""
