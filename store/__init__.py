"""OrbitKV store."""
