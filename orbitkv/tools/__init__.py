"""Command implementations behind ``orbitkv``: each module exposes ``main(argv) -> int``."""
