"""The simulator's configuration: the real simulator's keys, our ``ext-`` keys, and their rules.

One table (``KEYS``) drives YAML loading, command-line flags and ``/admin/config`` so a key
is spelt, parsed and validated the same way everywhere. Configurations are immutable: an
admin update builds and validates a whole new one, then swaps it in (see ``ConfigHolder``),
so a request never sees half an update.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmsim.durations import DurationError, format_duration, parse_duration

log = logging.getLogger("llmsim")

EXT_PREFIX = "ext-"
FAILURE_TYPES = (
    "rate_limit",
    "invalid_api_key",
    "context_length",
    "server_error",
    "invalid_request",
    "model_not_found",
)
LATENCY_CALCULATORS = ("", "constant", "per-token")
MODES = ("random", "echo")
# ``ext-compat`` values: "" is llmsim's own behaviour; the others reproduce a real release.
COMPAT_LLMD_V0_10_2 = "llm-d-v0.10.2"
COMPAT_MODES = ("", COMPAT_LLMD_V0_10_2)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class ExtraModel:
    """A further model served by the same process (``ext-models``), with its own tokenizer."""

    name: str
    aliases: tuple[str, ...] = ()
    tokenizer: str | None = None


@dataclass(frozen=True)
class SimConfig:
    """Every setting the simulator acts on; durations in seconds, rates in percent."""

    port: int = 8000
    model: str = ""
    served_model_name: tuple[str, ...] = ()
    mode: str = "random"
    seed: int | None = None
    max_model_len: int = 1024
    max_num_seqs: int = 5
    max_waiting_queue_length: int = 1000
    max_request_body_size_mb: int = 4
    time_to_first_token: float = 0.0
    time_to_first_token_std_dev: float = 0.0
    inter_token_latency: float = 0.0
    inter_token_latency_std_dev: float = 0.0
    latency_calculator: str = ""
    prefill_overhead: float = 0.0
    prefill_time_per_token: float = 0.0
    prefill_time_std_dev: float = 0.0
    time_factor_under_load: float = 1.0
    failure_injection_rate: float = 0.0
    failure_types: tuple[str, ...] = ()
    enable_request_id_headers: bool = False
    data_parallel_size: int = 1
    startup_duration: float = 0.0
    force_dummy_tokenizer: bool = False
    # Random tool calls (used by ``ext-compat: llm-d-v0.10.2``); the real simulator's defaults.
    max_tool_call_integer_param: int = 100
    min_tool_call_integer_param: int = 0
    max_tool_call_number_param: float = 100.0
    min_tool_call_number_param: float = 0.0
    max_tool_call_array_param_length: int = 5
    min_tool_call_array_param_length: int = 1
    tool_call_not_required_param_probability: int = 50
    object_tool_call_not_required_field_probability: int = 50
    # Extensions (ignored by the real simulator).
    ext_compat: str = ""
    ext_tokenizer: str | None = None
    ext_tokens_per_chunk: int = 1
    ext_models: tuple[ExtraModel, ...] = ()
    ext_disconnect_rate: float = 0.0
    ext_stall_rate: float = 0.0
    ext_stall_duration: float = 1.0
    ext_malformed_event_rate: float = 0.0
    ext_split_writes_rate: float = 0.0
    ext_stamp_events: bool = False
    ext_prefix_cache_block: int = 0
    ignored: Mapping[str, Any] = field(default_factory=dict)

    @property
    def served_names(self) -> tuple[str, ...]:
        """Names the main model answers to: the aliases, or the model itself without any."""
        return self.served_model_name or (self.model,)


# --- value parsers -------------------------------------------------------------------------


def _as_int(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        return int(value.strip())
    raise ValueError(f"expected an integer, got {value!r}")


def _as_float(value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r}")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        return float(value.strip())
    raise ValueError(f"expected a number, got {value!r}")


def _as_str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _as_optional_str(value: object) -> str | None:
    if value is None or value == "":
        return None
    return _as_str(value)


def _as_optional_int(value: object) -> int | None:
    return None if value is None else _as_int(value)


def _as_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def _as_str_list(value: object) -> tuple[str, ...]:
    # The real simulator's flags take space-separated lists; YAML takes proper lists.
    if isinstance(value, str):
        return tuple(value.split())
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"expected a list of strings, got {value!r}")


def _as_duration(value: object) -> float:
    try:
        return parse_duration(value)
    except DurationError as exc:
        raise ValueError(str(exc)) from exc


def _as_models(value: object) -> tuple[ExtraModel, ...]:
    if isinstance(value, str):
        value = yaml.safe_load(value)  # the flag takes YAML/JSON text
    if not isinstance(value, list):
        raise ValueError("expected a list of {name, aliases, tokenizer} entries")
    models = []
    for entry in value:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError(f"each entry needs a string 'name', got {entry!r}")
        unknown = set(entry) - {"name", "aliases", "tokenizer"}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)} in entry {entry['name']!r}")
        aliases = _as_str_list(entry.get("aliases", []))
        models.append(ExtraModel(entry["name"], aliases, _as_optional_str(entry.get("tokenizer"))))
    return tuple(models)


@dataclass(frozen=True, slots=True)
class KeySpec:
    """How one configuration key is parsed, shown, and whether ``/admin/config`` may change it."""

    attr: str
    parse: Callable[[object], Any]
    admin: bool = False
    is_duration: bool = False
    help: str = ""


def _key(attr: str, parse: Callable[[object], Any], **kw: Any) -> KeySpec:
    return KeySpec(attr, parse, is_duration=parse is _as_duration, **kw)


KEYS: dict[str, KeySpec] = {
    "port": _key("port", _as_int, help="port of rank 0"),
    "model": _key("model", _as_str, help="the loaded model (mandatory)"),
    "served-model-name": _key("served_model_name", _as_str_list, help="aliases"),
    "mode": _key("mode", _as_str, help="random or echo"),
    "seed": _key("seed", _as_optional_int),
    "max-model-len": _key("max_model_len", _as_int),
    "max-num-seqs": _key("max_num_seqs", _as_int),
    "max-waiting-queue-length": _key("max_waiting_queue_length", _as_int),
    "max-request-body-size-mb": _key("max_request_body_size_mb", _as_int),
    "time-to-first-token": _key("time_to_first_token", _as_duration, admin=True),
    "time-to-first-token-std-dev": _key("time_to_first_token_std_dev", _as_duration, admin=True),
    "inter-token-latency": _key("inter_token_latency", _as_duration, admin=True),
    "inter-token-latency-std-dev": _key("inter_token_latency_std_dev", _as_duration, admin=True),
    "latency-calculator": _key("latency_calculator", _as_str, admin=True),
    "prefill-overhead": _key("prefill_overhead", _as_duration, admin=True),
    "prefill-time-per-token": _key("prefill_time_per_token", _as_duration, admin=True),
    "prefill-time-std-dev": _key("prefill_time_std_dev", _as_duration, admin=True),
    "time-factor-under-load": _key("time_factor_under_load", _as_float, admin=True),
    "failure-injection-rate": _key("failure_injection_rate", _as_float, admin=True),
    "failure-types": _key("failure_types", _as_str_list, admin=True),
    "enable-request-id-headers": _key("enable_request_id_headers", _as_bool),
    "data-parallel-size": _key("data_parallel_size", _as_int),
    "startup-duration": _key("startup_duration", _as_duration),
    # llmsim never looks a model name up: its tokenizer is ext-tokenizer (or the compat one).
    "force-dummy-tokenizer": _key("force_dummy_tokenizer", _as_bool),
    "max-tool-call-integer-param": _key("max_tool_call_integer_param", _as_int),
    "min-tool-call-integer-param": _key("min_tool_call_integer_param", _as_int),
    "max-tool-call-number-param": _key("max_tool_call_number_param", _as_float),
    "min-tool-call-number-param": _key("min_tool_call_number_param", _as_float),
    "max-tool-call-array-param-length": _key("max_tool_call_array_param_length", _as_int),
    "min-tool-call-array-param-length": _key("min_tool_call_array_param_length", _as_int),
    "tool-call-not-required-param-probability": _key(
        "tool_call_not_required_param_probability", _as_int
    ),
    "object-tool-call-not-required-field-probability": _key(
        "object_tool_call_not_required_field_probability", _as_int
    ),
    "ext-compat": _key(
        "ext_compat",
        _as_str,
        help=f"'{COMPAT_LLMD_V0_10_2}': answer as llm-d-inference-sim v0.10.2 does on the wire "
        "(its dummy tokenizer, stock sentences, chunk shape, n, tools, logprobs; see "
        "docs/simulator.md); unset: llmsim's own behaviour",
    ),
    "ext-tokenizer": _key(
        "ext_tokenizer", _as_optional_str, help="o200k_base, cl100k_base or a .model path"
    ),
    "ext-tokens-per-chunk": _key("ext_tokens_per_chunk", _as_int, help="tokens per SSE event"),
    "ext-models": _key("ext_models", _as_models, help="YAML list of {name, aliases, tokenizer}"),
    "ext-disconnect-rate": _key("ext_disconnect_rate", _as_float, admin=True),
    "ext-stall-rate": _key("ext_stall_rate", _as_float, admin=True),
    "ext-stall-duration": _key("ext_stall_duration", _as_duration, admin=True),
    "ext-malformed-event-rate": _key("ext_malformed_event_rate", _as_float, admin=True),
    "ext-split-writes-rate": _key("ext_split_writes_rate", _as_float, admin=True),
    "ext-prefix-cache-block": _key(
        "ext_prefix_cache_block",
        _as_int,
        help="report prompt_tokens_details.cached_tokens: a repeated prompt has its whole "
        "blocks of this many tokens cached (0: off)",
    ),
    "ext-stamp-events": _key(
        "ext_stamp_events",
        _as_bool,
        admin=True,
        help="stamp each token event with its send time (ext_sent_ns, time.time_ns())",
    ),
}

# Keys the real simulator knows and this one does not act on: accepted with a warning so
# that real profiles load unchanged.
_IGNORED_TEXT = """block-size data-parallel-rank dataset-in-memory dataset-path dataset-table-name
    dataset-url default-embedding-dimensions ec-transfer-config enable-kvcache
    enable-prefix-caching no-enable-prefix-caching enable-sleep-mode no-enable-sleep-mode
    enforce-eager no-enforce-eager event-batch-size fake-metrics fake-metrics-refresh-interval
    global-cache-hit-threshold hash-seed image-emission-rate
    kv-cache-size kv-cache-transfer-latency kv-cache-transfer-latency-std-dev
    kv-cache-transfer-time-per-token kv-cache-transfer-time-std-dev kv-events-replay-endpoint
    kv-events-replay-queue-size log-http lora-modules max-cpu-loras max-loras
    mm-encoder-only no-mm-encoder-only mm-processor-kwargs mm-render-timeout
    omni no-omni render-timeout render-url
    self-signed-certs skip-tool-validation ssl-certfile ssl-keyfile tensor-parallel-size
    time-to-generate-image time-to-generate-image-std-dev tool-call-extra-call-probability
    use-vllm-map-event-format zmq-endpoint"""
IGNORED_KEYS: frozenset[str] = frozenset(_IGNORED_TEXT.split())

ADMIN_KEYS: tuple[str, ...] = tuple(k for k, spec in KEYS.items() if spec.admin)
_DURATION_STD_DEVS = (
    ("time-to-first-token-std-dev", "time-to-first-token"),
    ("inter-token-latency-std-dev", "inter-token-latency"),
)
_RATES = (
    "failure-injection-rate",
    "ext-disconnect-rate",
    "ext-stall-rate",
    "ext-malformed-event-rate",
    "ext-split-writes-rate",
)


def _parse_value(key: str, value: object) -> Any:
    try:
        return KEYS[key].parse(value)
    except (ValueError, TypeError, yaml.YAMLError) as exc:
        raise ConfigError(key, f"invalid value {value!r}: {exc}") from exc


def apply_values(base: SimConfig, values: Mapping[str, object]) -> SimConfig:
    """A new configuration with ``values`` (keyed by the real simulator's names) applied.

    Unknown keys are errors so a typo in a profile fails loudly; keys the real simulator
    knows but we don't implement are kept in ``ignored`` and warned about once.
    """
    changes: dict[str, Any] = {}
    ignored = dict(base.ignored)
    for key, value in values.items():
        if key in KEYS:
            changes[KEYS[key].attr] = _parse_value(key, value)
        elif key in IGNORED_KEYS:
            if key not in ignored:
                log.warning("configuration key %r is not implemented by llmsim; ignored", key)
            ignored[key] = value
        elif key == "config":
            continue
        else:
            hint = " (extension keys start with 'ext-')" if not key.startswith(EXT_PREFIX) else ""
            raise ConfigError(key, f"unknown configuration key{hint}")
    return dataclasses.replace(base, ignored=ignored, **changes)


def validate(cfg: SimConfig) -> SimConfig:
    """Raise ConfigError naming the first invalid key; return ``cfg`` when all is well."""
    if not cfg.model:
        raise ConfigError("model", "is mandatory (set it in the profile, --model or SIM_MODEL)")
    if cfg.mode not in MODES:
        raise ConfigError("mode", f"invalid mode {cfg.mode!r}, valid values are random and echo")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError("port", f"invalid port {cfg.port}")
    for key in KEYS:
        spec = KEYS[key]
        if spec.is_duration and getattr(cfg, spec.attr) < 0:
            raise ConfigError(key, "cannot be negative")
    for std_key, base_key in _DURATION_STD_DEVS:
        std = getattr(cfg, KEYS[std_key].attr)
        base = getattr(cfg, KEYS[base_key].attr)
        if std > 0.3 * base + 1e-12:
            raise ConfigError(std_key, f"cannot be more than 30% of {base_key}")
    if cfg.latency_calculator not in LATENCY_CALCULATORS:
        raise ConfigError(
            "latency-calculator",
            f"unknown calculator {cfg.latency_calculator!r}, supported: constant, per-token",
        )
    if cfg.time_factor_under_load < 1.0:
        raise ConfigError("time-factor-under-load", "cannot be less than 1.0")
    for key in _RATES:
        rate = getattr(cfg, KEYS[key].attr)
        if not 0 <= rate <= 100:
            raise ConfigError(key, f"should be between 0 and 100, got {rate}")
    for failure in cfg.failure_types:
        if failure not in FAILURE_TYPES:
            raise ConfigError(
                "failure-types",
                f"invalid failure type {failure!r}, valid types are: {', '.join(FAILURE_TYPES)}",
            )
    minimums = {
        "max-model-len": 1,
        "max-num-seqs": 1,
        "max-waiting-queue-length": 0,
        "ext-tokens-per-chunk": 1,
        "max-request-body-size-mb": 1,
        "data-parallel-size": 1,
    }
    for key, minimum in minimums.items():
        if getattr(cfg, KEYS[key].attr) < minimum:
            raise ConfigError(key, f"cannot be less than {minimum}")
    if cfg.data_parallel_size > 8:
        raise ConfigError("data-parallel-size", "must be between 1 and 8")
    if cfg.max_request_body_size_mb > 512:
        raise ConfigError("max-request-body-size-mb", "must be between 1 and 512")
    names = list(cfg.served_names)
    for extra in cfg.ext_models:
        names.extend((extra.name, *extra.aliases))
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError("ext-models", f"model names served twice: {duplicates}")
    _validate_tool_calls(cfg)
    _validate_compat(cfg)
    return cfg


def _validate_tool_calls(cfg: SimConfig) -> None:
    for low, high in (
        ("min-tool-call-integer-param", "max-tool-call-integer-param"),
        ("min-tool-call-number-param", "max-tool-call-number-param"),
        ("min-tool-call-array-param-length", "max-tool-call-array-param-length"),
    ):
        if getattr(cfg, KEYS[high].attr) < getattr(cfg, KEYS[low].attr):
            raise ConfigError(high, f"cannot be less than {low}")
    if cfg.min_tool_call_array_param_length < 0:
        raise ConfigError("min-tool-call-array-param-length", "cannot be negative")
    for key in (
        "tool-call-not-required-param-probability",
        "object-tool-call-not-required-field-probability",
    ):
        if not 0 <= getattr(cfg, KEYS[key].attr) <= 100:
            raise ConfigError(key, "should be between 0 and 100")


# What llmsim adds on top of the real simulator has no place in a copy of the real one.
_NOT_IN_COMPAT = (
    ("ext-tokenizer", None),
    ("ext-models", ()),
    ("ext-tokens-per-chunk", 1),
    ("ext-prefix-cache-block", 0),
    ("ext-disconnect-rate", 0.0),
    ("ext-stall-rate", 0.0),
    ("ext-malformed-event-rate", 0.0),
    ("ext-split-writes-rate", 0.0),
    ("ext-stamp-events", False),
)


def _validate_compat(cfg: SimConfig) -> None:
    if cfg.ext_compat not in COMPAT_MODES:
        raise ConfigError(
            "ext-compat", f"unknown value {cfg.ext_compat!r}; valid: {COMPAT_LLMD_V0_10_2!r}"
        )
    if not cfg.ext_compat:
        return
    for key, neutral in _NOT_IN_COMPAT:
        if getattr(cfg, KEYS[key].attr) != neutral:
            raise ConfigError(key, "is an llmsim extension, not available with ext-compat")
    if cfg.max_waiting_queue_length < 1:
        raise ConfigError("max-waiting-queue-length", "cannot be less than 1 (as in v0.10.2)")


def load_yaml(path: Path) -> dict[str, object]:
    """The key/value mapping of a profile file."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError("config", f"{path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping of keys to values")
    return {str(k): v for k, v in data.items()}


def build_config(
    yaml_path: Path | None,
    flag_values: Mapping[str, object],
    environ: Mapping[str, str] = os.environ,
) -> SimConfig:
    """Defaults < YAML < ``SIM_MODEL`` (only without ``--model``) < flags, then validated."""
    cfg = SimConfig()
    if yaml_path is not None:
        cfg = apply_values(cfg, load_yaml(yaml_path))
    if "model" not in flag_values and environ.get("SIM_MODEL"):
        cfg = dataclasses.replace(cfg, model=environ["SIM_MODEL"])
    cfg = apply_values(cfg, flag_values)
    return validate(cfg)


def admin_update(cfg: SimConfig, update: object) -> SimConfig:
    """The configuration after a ``POST /admin/config`` body, or ConfigError leaving it intact."""
    if not isinstance(update, dict):
        raise ConfigError("body", "must be a JSON object of configuration keys")
    for key in update:
        if key not in KEYS or not KEYS[key].admin:
            raise ConfigError(
                key, f"is not admin-configurable; allowed keys: {', '.join(ADMIN_KEYS)}"
            )
    return validate(apply_values(cfg, update))


def to_public_dict(cfg: SimConfig) -> dict[str, Any]:
    """The configuration under the real key names, durations as Go strings (GET /admin/config)."""
    out: dict[str, Any] = {}
    for key, spec in KEYS.items():
        value = getattr(cfg, spec.attr)
        if spec.is_duration:
            value = format_duration(value)
        elif isinstance(value, tuple):
            value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
        out[key] = value
    out["served-model-name"] = list(cfg.served_names)
    return out


class ConfigHolder:
    """The current configuration; replaced whole, so readers take one consistent snapshot."""

    def __init__(self, cfg: SimConfig) -> None:
        self.current = cfg

    def replace(self, update: object) -> SimConfig:
        # No await between read and write: updates are serialised by the event loop.
        self.current = admin_update(self.current, update)
        return self.current


def keys_for_flags() -> Iterable[tuple[str, KeySpec | None]]:
    """Every key a flag exists for: ours with their spec, the ignored ones without."""
    yield from KEYS.items()
    for key in sorted(IGNORED_KEYS):
        yield key, None
