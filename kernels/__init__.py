"""OrbitKV kernels."""
