"""OrbitKV's extension of vLLM's scheduler (``--scheduler-cls``): the ``Scheduler`` /
``AsyncScheduler`` subclass that serves holes (``hole_scheduler``), its exactness duties
(``exact_guard``) and the per-request block hasher that keeps approximate KV out of exact requests'
reach in vLLM's prefix cache (``prefix_lineage``); and, in vLLM's front end, the hooks that vouch
for the media hashes vLLM made itself (``mm_hashes``). They override or wrap vLLM methods, which
vLLM does not keep stable: ``tests/connector/test_vllm_ext_overrides.py`` checks that each still
exists.
"""
