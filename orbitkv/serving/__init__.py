"""Launching vLLM's OpenAI server with OrbitKV (``orbitkv serve``) and managing it as a child process."""
