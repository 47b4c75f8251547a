"""The connector's scheduler half (``half.SchedulerHalf``) and what it decides with: per request at
admission the options, chunks and plan (``admission``, ``planner``, ``relocation``, ``lineage``,
``calibration``), then per step the loads and saves (``request_state``, ``saves``), the worker's
reports (``reported``), the live audit's samples (``audit``), KV events (``kv_events``) and LMCache
interop (``lmcache_bridge``)."""
