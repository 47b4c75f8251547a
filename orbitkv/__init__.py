"""OrbitKV: position-free KV-cache reuse for vLLM."""

__version__ = "0.1.0"
