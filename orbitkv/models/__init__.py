"""Tiny local models OrbitKV is tested on: config + tokenizer + seeded weights, and Hugging Face reference runs."""
