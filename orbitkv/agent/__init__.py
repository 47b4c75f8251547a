"""Agent workloads over an OpenAI-compatible server: the trace, the HTTP driver, and ``orbitkv demo``."""
