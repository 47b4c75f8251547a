"""The lab's checks with tiny models (``orbitkv check ...``), each printing a JSON table."""
