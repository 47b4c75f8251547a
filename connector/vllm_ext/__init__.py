"""OrbitKV's extension of vLLM's scheduler (``--scheduler-cls``): the ``Scheduler`` /
``AsyncScheduler`` subclass that serves holes (``hole_scheduler``), its exactness duties
(``exact_guard``) and the per-request block hasher that keeps approximate KV out of exact requests'
reach in vLLM's prefix cache (``prefix_lineage``). They override vLLM private methods, which vLLM
does not keep stable: ``tests/connector/test_vllm_ext_overrides.py`` checks that each still exists.
"""
