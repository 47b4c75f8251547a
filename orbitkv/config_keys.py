"""The names ``OrbitKVConfig`` reads: its environment prefix and file variables, its section and
key prefix in a YAML file, and LMCache's keys (those read with LMCache's meaning, and those
accepted and ignored so that an LMCache file loads unchanged)."""

from __future__ import annotations

ENV_PREFIX = "ORBITKV_"
CONFIG_FILE_ENVS = ("ORBITKV_CONFIG_FILE", "LMCACHE_CONFIG_FILE")
# ORBITKV_* names that belong to tooling, not to the config; everything else must be a field.
RESERVED_ENV = frozenset({"ORBITKV_CONFIG_FILE", "ORBITKV_SLOW", "ORBITKV_LAUNCH_KEY"})
# The per-launch secret vLLM's processes share (``config.launch_key``): made, never configured.
LAUNCH_KEY_ENV = "ORBITKV_LAUNCH_KEY"
SECTION = "orbitkv"
PREFIX = "orbitkv_"

# LMCache keys read with LMCache's meaning; they are also valid at top level of a file.
LMCACHE_KEYS = frozenset(
    "chunk_size local_cpu max_local_cpu_size local_disk max_local_disk_size remote_url cache_policy "
    "save_unfull_chunk pre_caching_hash_algorithm remote_serde".split()
)
# The rest of LMCache 0.5.6's config keys (v1/config.py _CONFIG_DEFINITIONS and its aliases):
# accepted so that an LMCache file loads, and ignored because OrbitKV has no such feature.
LMCACHE_IGNORED_KEYS = frozenset(
    """
    local_cpu_use_hugepages reserve_local_cpu_size local_disk_path_sharding use_layerwise
    save_decode_cache enable_blending blend_recompute_ratios blend_thresholds blend_check_layers
    blend_min_tokens blend_special_str retrieve_locations store_location enable_p2p p2p_host
    p2p_init_ports p2p_lookup_ports mp_host mp_port enable_controller lmcache_instance_id
    controller_pull_url controller_reply_url lmcache_worker_ports lmcache_worker_ids
    lmcache_worker_heartbeat_delay_time lmcache_worker_heartbeat_time enable_pd pd_role
    pd_buffer_size pd_buffer_device pd_peer_host pd_peer_init_port pd_peer_alloc_port
    pd_peer_query_port pd_proxy_host pd_proxy_port pd_allocation_timeout_sec
    pd_shutdown_timeout_sec pd_condition_poll_interval_sec pd_max_prefill_len pd_backend_mode
    pd_skip_proxy_notification pd_bidirectional transfer_channel nixl_backends nixl_buffer_size
    nixl_buffer_device gds_path gds_path_sharding gds_buffer_size maru_path maru_pool_size use_gds
    gds_backend audit_actual_remote_url internal_api_server_host extra_config blocking_timeout_secs
    external_lookup_client py_enable_gc numa_mode enable_async_loading internal_api_server_enabled
    internal_api_server_port_start priority_limit internal_api_server_include_index_list
    internal_api_server_socket_path_prefix runtime_plugin_locations storage_plugins
    remote_storage_plugins lookup_timeout_ms min_retrieve_tokens hit_miss_ratio
    lookup_server_worker_ids enable_scheduler_bypass_lookup script_allowed_imports
    run_script_api_enabled enable_lazy_memory_allocator lazy_memory_initial_ratio
    lazy_memory_expand_trigger_ratio lazy_memory_step_ratio lazy_memory_safe_size
    enable_chunk_statistics chunk_statistics_auto_start_statistics
    chunk_statistics_auto_exit_timeout_hours chunk_statistics_auto_exit_target_unique_chunks
    chunk_statistics_strategy enable_kv_events use_gpu_connector_v3 pin_timeout_sec
    pin_check_interval_sec remote_config_url app_id enable_hidden_state_cache
    max_hidden_state_cpu_size hidden_state_layers hidden_states_retrieve_mode enable_xpyd
    nixl_peer_host nixl_peer_init_port nixl_peer_alloc_port nixl_proxy_host nixl_proxy_port
    nixl_role controller_url lmcache_worker_port plugin_locations external_backends nixl_peer_port
    """.split()
)
