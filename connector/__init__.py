"""OrbitKV connector."""
