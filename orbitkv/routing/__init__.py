"""KV-aware routing: OrbitKV's tier events (``tier_events``) and the chunk-set scorer (``scorer``)."""
