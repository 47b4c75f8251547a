"""OrbitKV's extension of vLLM's scheduler (``--scheduler-cls``): the ``Scheduler`` /
``AsyncScheduler`` subclass that serves holes (``hole_scheduler``), its exactness duties
(``exact_guard``) and the per-request block hasher that keeps approximate KV out of exact requests'
reach in vLLM's prefix cache (``prefix_lineage``)."""
