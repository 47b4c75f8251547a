"""OrbitKV configuration: one frozen dataclass, and the only reader of config files and ``ORBITKV_*``.

Sources, lowest precedence first: defaults < config file < ``ORBITKV_<NAME>`` env vars < overrides
(``load(overrides=...)``, or vLLM's ``kv_connector_extra_config``).

The file is LMCache's YAML format: LMCache's keys that mean the same thing here
(``config_keys.LMCACHE_KEYS``) at top level; OrbitKV's own under an ``orbitkv:`` section or prefixed
``orbitkv_``, so they never collide with a future LMCache key. Other LMCache keys are ignored
(``ignored_lmcache_keys``, and logged), so an LMCache file loads unchanged. Any other key is a
``ValueError`` naming the key and its source.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from orbitkv import config_sources as sources
from orbitkv.config_keys import CONFIG_FILE_ENVS, LAUNCH_KEY_ENV, PREFIX
from orbitkv.config_values import (
    RemoteSpec,
    parse_bool,
    parse_names,
    parse_number,
    parse_remote_url,
    parse_strings,
    parse_tokens,
)

__all__ = ["CONFIG_FILE_ENVS", "OrbitKVConfig", "RemoteSpec", "env_keys", "parse_remote_url"]

logger = logging.getLogger(__name__)

GB = 1 << 30
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Glob characters of Redis ACL key patterns, and the prefix separator.
_ACL_PATTERN_CHARS = "*?[]\\: \t\n"
HASH_ALGORITHMS = ("builtin", "sha256", "sha256_cbor", "sha256_cbor_64bit", "xxhash", "xxhash_cbor")


def _key(default: Any, kind: str | tuple, low: float | None = None, high: float | None = None) -> Any:
    """A config key: its default and rule. ``kind`` ending in ``?`` accepts null; a tuple is a choice."""
    return dataclasses.field(default=default, metadata={"rule": (kind, low, high)})


# Values an earlier release took, and what to write instead (the start-up error says so).
RETIRED_VALUES = {
    ("approximate_reuse", "salted"): "a cache_salt no longer opts in to approximate KV: use "
    "'request' (a request opts in with kv_transfer_params.orbitkv.approximate=true) or 'off'",
    ("approximate_reuse", "shared"): "use 'all' (every request receives approximate KV)",
}


def _coerce(name: str, value: Any) -> Any:
    kind, low, high = _RULES[name]
    retired = RETIRED_VALUES.get((name, str(value).lower()))
    if retired:
        raise ValueError(f"{name}: {value!r} is no longer a value: {retired}")
    if isinstance(kind, tuple):  # a choice, matched case-insensitively, stored as spelled in kind
        match = [c for c in kind if c == value or str(c).lower() == str(value).lower()]
        if not match:
            raise ValueError(f"{name}: expected one of {kind}, got {value!r}")
        return match[0]
    if kind.endswith("?"):
        if value is None or str(value).strip().lower() in ("", "none", "null"):
            return None
        kind = kind[:-1]
    if kind == "bool":
        return parse_bool(name, value)
    if kind == "tokens":
        return parse_tokens(name, value)
    if kind == "names":
        return parse_names(name, value)
    if kind == "strings":
        return parse_strings(name, value)
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"{name}: expected a string, got {value!r}")
        return value
    number = parse_number(name, value, int if kind == "int" else float)
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name}: {value!r} is out of range [{low}, {high or 'inf'}]")
    return number


@dataclasses.dataclass(frozen=True)
class OrbitKVConfig:
    # LMCache keys, same meaning (sizes in GB of 2**30 bytes, as LMCache reads them).
    chunk_size: int = _key(256, "int", 1, 1 << 20)
    local_cpu: bool = _key(True, "bool")
    max_local_cpu_size: float = _key(5.0, "float", 0)
    local_disk: str | None = _key(None, "str?")
    # LMCache's default is 0, a disk tier that holds nothing; a usable budget is kinder.
    max_local_disk_size: float = _key(10.0, "float", 0)
    remote_url: str | None = _key(None, "str?")
    cache_policy: str = _key("LRU", ("LRU",))
    save_unfull_chunk: bool = _key(False, "bool")
    pre_caching_hash_algorithm: str = _key("builtin", HASH_ALGORITHMS)
    # LMCache's serdes; store/lmcache.py reads and writes only "naive" (raw KV_2LTD bytes).
    remote_serde: str | None = _key("naive", ("naive", "kivi", "cachegen", None))
    # OrbitKV: reuse.
    # "content": text cut at content-defined points (connector/cdc.py), so text that moved or
    # whose tail changed still matches; "fixed": LMCache's runs of chunk_size from each stretch.
    text_chunking: str = _key("content", ("content", "fixed"))
    tenant: str = _key("", "str")
    # Tenants a request may pick with kv_transfer_params.orbitkv.tenant (none: the tenant is the
    # deployment's alone; a request naming another is served by vLLM without OrbitKV).
    request_tenants: tuple[str, ...] = _key((), "strings")
    # Who may receive approximate KV (survivor, transfer, patched, orbit, blind, recompute): "off" nobody (every
    # request is served exact); "request" a request that opts in with
    # kv_transfer_params.orbitkv.approximate = true; "all" every request (the deployment opts in for
    # all of them: one trust domain). A cache_salt isolates; it never opts in.
    approximate_reuse: str = _key("off", ("off", "request", "all"))
    # The table `orbitkv bench fidelity --write-calibration` writes (connector/scheduler/calibration.py): per
    # model fingerprint and modality, the approximate modes measured within the answer budget on the
    # served model. With require_calibration an approximate mode is served only where it says so.
    calibration_file: str | None = _key(None, "str?")
    # Off only for labs and benches that measure uncalibrated modes (logged at start-up).
    require_calibration: bool = _key(True, "bool")
    # The live audit (connector/scheduler/audit.py, orbitkv/serving/audit.py): this share of the requests that
    # received approximate KV is recomputed exactly in idle time; a mode whose audited disagreement
    # (top-1 differs, or first-token KL over audit_max_kl) exceeds its budget (the calibration's,
    # else audit_max_disagreement) is switched off for this model once audit_min_samples are in.
    audit_fraction: float = _key(0.05, "float", 0, 1)
    audit_min_samples: int = _key(20, "int", 1, 1 << 20)
    audit_max_disagreement: float = _key(0.05, "float", 0, 1)
    audit_max_kl: float = _key(0.1, "float", 0, 1e6)
    # Where audit samples and verdicts live (shared by the engine and orbitkv serve's auditor);
    # None: <local_disk>/audit, or no audit without a disk tier.
    audit_dir: str | None = _key(None, "str?")
    enable_exact: bool = _key(True, "bool")
    enable_survivor: bool = _key(True, "bool")
    enable_blind: bool = _key(False, "bool")
    # Selective recompute (connector/scheduler/recompute.py): a text chunk served as its canonical,
    # relocated, with its first recompute_fraction of tokens (at least one) computed fresh in
    # context by vLLM and the rest loaded as a hole behind them. Approximate, so like every
    # approximate mode it is served only under approximate_reuse and the calibration; needs holes
    # (min_hole_tokens > 0). A request may ask another fraction (kv_transfer_params.orbitkv.
    # recompute_fraction), which is another policy, calibrated on its own.
    enable_recompute: bool = _key(False, "bool")
    recompute_fraction: float = _key(0.15, "float", 0.01, 1)
    save_canonical: bool = _key(True, "bool")
    # Which computed chunks are saved (connector/scheduler/save_admission.py): "recurring", a
    # chunk once it is computed again under the same key (vLLM's prefix cache did not keep it; an
    # approximate request: the same content) or its item is registered; "all", every chunk on
    # first sight (a save costs a gather in the forward and an encode on the same cores).
    save_admission: str = _key("recurring", ("recurring", "all"))
    # Keys the "recurring" policy remembers (least recently seen forgotten first).
    save_admission_keys: int = _key(1 << 18, "int", 1, 1 << 26)
    anchor_tokens: tuple[int, ...] | None = _key(None, "tokens?")  # None: the model's BOS
    # From docs/figures/fidelity.json: the smallest rank whose patch recovers every flipped answer
    # on all five arches (rank 16 leaves llama at 0.71); eta >= 0.997 there. 0: no patches.
    patch_rank: int = _key(32, "int", 0, 4096)
    # A patch is m (N + H*D) numbers per layer and side: store it only under this fraction of the
    # chunk's own KV bytes (a short chunk keeps its conditioned entry instead).
    patch_max_bytes_fraction: float = _key(0.5, "float", 0, 1e6)
    # The dtype patch factors are stored in: bfloat16 halves a patch's bytes (the product is
    # still formed in fp32 at load; a full-rank patch is then no longer exact to the last bit).
    patch_dtype: str = _key("float32", ("float32", "bfloat16", "float16"))
    # Once a patch of B after A is stored and is smaller than the conditioned entry KV(B|A), drop
    # that entry: the store keeps canonical + patches (approximate, "patched") in its place. Off
    # by default: a conditioned entry serves exact KV.
    patch_replaces_conditioned: bool = _key(False, "bool")
    # Patch only the layers from this fraction of the depth on (0: all). The fidelity lab's
    # deep-only arm loses eta (0.68-0.92 at rank 32), so all layers by default.
    patch_first_layer_fraction: float = _key(0.0, "float", 0, 1)
    # Patches are formed off the forward's critical path (connector/worker/patch_queue.py): when the
    # engine has been idle this long, or once a queued patch has waited patch_max_delay_s.
    patch_idle_s: float = _key(0.05, "float", 0, 3600)
    patch_max_delay_s: float = _key(5.0, "float", 0, 86400)
    patch_queue_depth: int = _key(256, "int", 1, 1 << 20)
    # Modalities ("text", "image", "video", ...) a chunk may be served blind for: canonical only,
    # no conditioning (the paper: no gap on dense text, multi-hop accuracy halved on images).
    blind_modalities: tuple[str, ...] = _key((), "names")
    # Modalities a chunk may be served by transfer for (connector/scheduler/relocation.py): its entry behind
    # the closest other stored antecedent (a rotated window, an image back behind a new window),
    # relocated, the inserted chunks' influence missing. Text after images reads them: a text
    # entry from another window carries that window's images (`check window`: eta 0.04 on a slide
    # with the question transferred, 0.75 without), so images and video are the useful scope.
    transfer_modalities: tuple[str, ...] = _key((), "names")
    # Modalities served by transfer only from a stored antecedent that ends with the same chunk as
    # the current one: an observation that moved with its screenshot (it reads that screenshot
    # first), never a question behind a changed window (`check window`: eta unchanged on every
    # operation; `bench agent`: reorders at their content floor). The bench's window arm: text.
    transfer_attached_modalities: tuple[str, ...] = _key((), "names")
    load_async: bool = _key(True, "bool")
    # Cached chunks behind fresh tokens ("holes", served with the scheduler extension): the
    # shortest hole worth splitting a prefill into one more forward step; 0 turns holes off.
    min_hole_tokens: int = _key(16, "int", 0, 1 << 20)
    # Holes under vLLM's model runner V2 (its GPU default): a jumped request is re-sent as a new
    # request so that V2's device-side computed count moves with it. Checked against V2's code on
    # the CPU only, so off until a GPU run confirms it: holes are then refused under V2, and
    # orbitkv serve starts vLLM with VLLM_USE_V2_MODEL_RUNNER=0 while holes are on.
    enable_v2_holes: bool = _key(False, "bool")
    # Vision encoder outputs in the store too (vLLM's encoder-cache connector, connector/encoder/),
    # so an image whose KV must be computed again skips the encoder; orbitkv serve turns vLLM's
    # --ec-transfer-config on with it.
    enable_encoder_cache: bool = _key(True, "bool")
    # OrbitKV: store (attribute names that store/settings.py reads).
    # fsync each disk entry before its rename: off by default. The tier is a cache: every entry is
    # checksummed and verified on read, so a file a crash left torn or empty is a miss (and is
    # deleted), and durability buys nothing a recompute does not. The flushes run beside the
    # forward on the engine's cores: the demo on a 2-core VM x0.86-0.91 against APC with them,
    # x1.02-1.08 without (docs/performance.md, eleventh session).
    disk_fsync: bool = _key(False, "bool")
    disk_writer_threads: int = _key(2, "int", 1, 64)
    write_queue_depth: int = _key(1024, "int", 1, 1 << 20)
    # Memory held by the queues between the engine and the tiers, in bytes as well as in jobs
    # (32 MiB chunks x 1,024 jobs would be 32 GiB): each lower tier's write-behind queue, the save
    # writer (gathered KV not yet in the store) and the patch queue (the inputs of patches not yet
    # formed). Over a cap a save or a write is dropped and counted (a later request recomputes it),
    # never queued: so these add at most their sum (plus one entry each) to max_local_cpu_size.
    write_queue_max_nbytes: int = _key(256 << 20, "int", 1, 1 << 50)
    save_queue_max_nbytes: int = _key(256 << 20, "int", 1, 1 << 50)
    # A save made during a step's forward reaches the writer when the forward ends, and waits while
    # a later forward runs, at most this long after it was made (0: never waits): the writer's CPU
    # and GIL time would come out of the forward's.
    save_hold_max_s: float = _key(1.0, "float", 0, 3600)
    patch_queue_max_nbytes: int = _key(256 << 20, "int", 1, 1 << 50)
    # A Redis call may take remote_timeout_s plus its bytes at this rate (bytes per second): a
    # 64 MiB chunk gets 2.6 s more at the default, a small one about remote_timeout_s.
    remote_min_nbytes_per_s: float = _key(float(25 << 20), "float", 1, 1e12)
    remote_ttl_s: float = _key(7 * 24 * 3600.0, "float", 0)  # 0: no TTL, Redis evicts
    remote_timeout_s: float = _key(1.0, "float", 1e-3, 3600)
    # Redis lookups the scheduler plans with run on the engine's critical path: a slow or frozen
    # Redis costs a request at most this (then the breaker answers misses at once).
    remote_lookup_timeout_s: float = _key(0.1, "float", 1e-3, 3600)
    remote_connect_timeout_s: float = _key(0.5, "float", 1e-3, 3600)
    remote_backoff_s: float = _key(0.5, "float", 0, 3600)
    remote_key_prefix: str = _key("", "str")
    store_max_antecedents: int = _key(32, "int", 1, 1 << 16)
    # A hit refreshes the lower tiers' recency (and refills a Redis that lost the entry) at most
    # this often per key: recency at this granularity, bounded background traffic.
    tier_refresh_interval_s: float = _key(30.0, "float", 0, 86400)
    # OrbitKV: operations.
    log_level: str = _key("INFO", LOG_LEVELS)
    metrics_port: int | None = _key(None, "int?", 0, 65535)
    # OrbitKV: mixed fleets with LMCache (connector/scheduler/lmcache_bridge.py, deploy/README.md). On: prefix
    # chunks LMCache nodes wrote to remote_url are served as exact hits, and this node writes its
    # prefix chunks in LMCache's layout too. lmcache_model_name is the model name in LMCache's keys
    # (None: vLLM's model, as LMCache's vLLM adapter names it).
    lmcache_interop: bool = _key(False, "bool")
    lmcache_model_name: str | None = _key(None, "str?")
    # OrbitKV: trust (deploy/README.md, Security). Multimodal items are keyed by a hash of their
    # processed inputs (connector/mm_identity.py); true: by vLLM's identifier as given, which is a
    # client's chat-part uuid when it sends one (only where the clients are one trust domain).
    trust_client_mm_ids: bool = _key(False, "bool")
    # An item vLLM hashed from its content (no client uuid) is keyed by that hash, which vLLM's
    # front end vouches for with a per-launch key (connector/vllm_ext/mm_hashes.py): the engine
    # does not hash its inputs again. false: every item's processed inputs are hashed, so an
    # image gets one id whether a client names it or not.
    use_vllm_mm_hashes: bool = _key(True, "bool")
    # A file holding this deployment's secret (>= 16 bytes): every Redis entry then carries a keyed
    # BLAKE3 tag over its key and bytes (store/signing.py); an unsigned or wrongly signed entry is
    # a miss. A path, so the secret is never on a command line. The Redis keys are also prefixed
    # with the deployment's tenant (redis_key_prefix), so a Redis ACL user can be held to them.
    entry_signing_key_file: str | None = _key(None, "str?")
    # OrbitKV: KV events for every tier (orbitkv/routing/tier_events.py), published through vLLM's
    # --kv-events-config publisher for KV-aware routers. Off: no listener on the store at all.
    # kv_events_max_queue bounds the events held between two scheduler steps (oldest dropped).
    kv_events: bool = _key(False, "bool")
    kv_events_max_queue: int = _key(65536, "int", 1, 1 << 24)
    # Bookkeeping, not a key: the LMCache keys that were present and ignored.
    ignored_lmcache_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in _RULES:
            object.__setattr__(self, name, _coerce(name, getattr(self, name)))
        if self.local_disk is not None:
            object.__setattr__(self, "local_disk", str(_disk_path(self.local_disk)))
        if self.remote_url is not None:
            object.__setattr__(self, "remote_url", parse_remote_url(self.remote_url).url)
        if any(c in self.tenant for c in _ACL_PATTERN_CHARS):
            raise ValueError(f"tenant: {self.tenant!r} may not hold any of {_ACL_PATTERN_CHARS!r} "
                             "(it is part of the Redis key prefix an ACL pattern matches)")
        if self.entry_signing_key_file is not None:
            self.entry_signing_key  # noqa: B018 - a missing or short key fails at start-up

    # Derived values, so that no caller repeats the unit conversions.
    @property
    def local_cpu_nbytes(self) -> int:
        return int(self.max_local_cpu_size * GB) if self.local_cpu else 0

    @property
    def local_disk_path(self) -> Path | None:
        return None if self.local_disk is None else Path(self.local_disk)

    @property
    def local_disk_nbytes(self) -> int:
        return int(self.max_local_disk_size * GB) if self.local_disk is not None else 0

    @property
    def is_forming_patches(self) -> bool:
        """Whether this server forms patches: only one that can serve them (a rank, and
        approximate reuse on) does; an exact-only server never reads a patch."""
        return self.patch_rank > 0 and self.approximate_reuse != "off"

    @property
    def audit_path(self) -> Path | None:
        if self.audit_dir is not None:
            return Path(self.audit_dir)
        return None if self.local_disk is None else Path(self.local_disk) / "audit"

    @property
    def remote(self) -> RemoteSpec | None:
        return None if self.remote_url is None else parse_remote_url(self.remote_url)

    @property
    def redis_key_prefix(self) -> str:
        """Every Redis key's prefix: ``remote_key_prefix``, then the deployment's tenant, so that
        a Redis ACL user's ``~<prefix>*`` holds a deployment to its own keys."""
        return self.remote_key_prefix + (f"{self.tenant}:" if self.tenant else "")

    @property
    def entry_signing_key(self) -> bytes | None:
        """The secret in ``entry_signing_key_file`` (surrounding whitespace dropped), or None."""
        if self.entry_signing_key_file is None:
            return None
        try:
            secret = Path(self.entry_signing_key_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"entry_signing_key_file: cannot read it ({exc.strerror})") from None
        if len(secret) < 16:
            raise ValueError("entry_signing_key_file: the key must be at least 16 bytes")
        return secret

    # The names store/settings.py reads for the two write-behind knobs.
    store_writer_threads = property(lambda self: self.disk_writer_threads)
    store_queue_depth = property(lambda self: self.write_queue_depth)

    def to_dict(self, *, is_redacted: bool = True) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if is_redacted and self.remote is not None:
            out["remote_url"] = self.remote.redacted_url
        return out

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> OrbitKVConfig:
        env = os.environ if env is None else env
        if path is None:
            path = next((env[name] for name in CONFIG_FILE_ENVS if env.get(name)), None)
        values: dict[str, Any] = {}
        ignored: set[str] = set()
        if path is not None:
            values.update(_from_document(sources.read_yaml(Path(path)), f"config file {path}", ignored))
        values.update(_from_env(env))
        if overrides:
            values.update(_from_document(overrides, "overrides", ignored, is_flat_ok=True))
        if ignored:
            logger.warning("OrbitKV ignores these LMCache keys: %s", ", ".join(sorted(ignored)))
        return cls(**values, ignored_lmcache_keys=tuple(sorted(ignored)))

    @classmethod
    def from_kv_connector_extra_config(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> OrbitKVConfig:
        """vLLM's ``kv_connector_extra_config``: the file's keys, highest precedence; a file named
        by ``orbitkv_config_file`` is read first."""
        extra = dict(extra or {})
        path = extra.pop(PREFIX + "config_file", None)
        return cls.load(path=path, overrides=extra, env=env)


_RULES: dict[str, tuple[str | tuple, float | None, float | None]] = {
    f.name: f.metadata["rule"] for f in dataclasses.fields(OrbitKVConfig) if "rule" in f.metadata
}


def _disk_path(value: str) -> Path:
    raw = value.strip()
    if "," in raw:
        raise ValueError(f"local_disk: one directory is supported, got {value!r}")
    if raw.startswith("file://"):
        raw = unquote(raw[len("file://") :])
    if not raw.startswith("/"):
        raise ValueError(
            f"local_disk: expected 'file:///absolute/path' or an absolute path, got {value!r}"
        )
    return Path(raw)


def _from_document(
    doc: Mapping[str, Any], source: str, ignored: set[str], *, is_flat_ok: bool = False
) -> dict[str, Any]:
    return sources.from_document(doc, source, ignored, _RULES, _coerce, is_flat_ok=is_flat_ok)


def env_keys(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The keys ``env`` sets (``ORBITKV_<NAME>``, checked as ``load`` reads them; an empty value
    is unset)."""
    return frozenset(_from_env(os.environ if env is None else env))


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    return sources.from_env(env, _RULES, _coerce)


def launch_key(env: Mapping[str, str] | None = None) -> bytes | None:
    """The per-launch secret vLLM's front end vouches for its media hashes with
    (``LAUNCH_KEY_ENV``: 32 bytes in hex, made by ``ensure_launch_key``), or None when unset or
    malformed (then nothing is vouched for, and every item's inputs are hashed)."""
    raw = (os.environ if env is None else env).get(LAUNCH_KEY_ENV, "")
    try:
        key = bytes.fromhex(raw)
    except ValueError:
        return None
    return key if len(key) == 32 else None


def ensure_launch_key(env: MutableMapping[str, str] | None = None) -> None:
    """Make the launch key if this process has none. vLLM's plugin hook runs in its first process
    before it starts the API servers and engines, which inherit the environment: one key a launch,
    never on a command line or in a file."""
    env = os.environ if env is None else env
    if launch_key(env) is None:
        env[LAUNCH_KEY_ENV] = secrets.token_hex(32)
