"""Role configs: YAML in, frozen dataclasses out.

    sections.py   the frozen dataclasses (Config and its sections) and the allowed choices
    loader.py     YAML and ``--set`` overrides -> a typed Config (load_config, config_from_dict)
    validate.py   value checks naming the field and the file (or the --set) it came from
    router.py     the router's own config (``pdkv router``; not a role): pdkv.config.router

``from pdkv.config import Config, load_config, ...`` stays the way to use it.
"""

from pdkv.config.loader import _read_yaml, config_from_dict, config_to_dict, load_config
from pdkv.config.sections import (ATTENTION_BACKENDS, DTYPES, LAYOUTS, MAX_SPEC_TOKENS, ROLES, SPEC_METHODS,
                                  TRANSPORTS, Config, ConfigError, DisaggConfig, DraftModelConfig, KVCacheConfig, LibfabricConfig,
                                  MessengerConfig,
                                  ModelConfig, ParallelConfig, SchedulerConfig, ServerConfig, SpeculativeConfig)
from pdkv.config.validate import validate

__all__ = ["ATTENTION_BACKENDS", "DTYPES", "LAYOUTS", "MAX_SPEC_TOKENS", "ROLES", "SPEC_METHODS", "TRANSPORTS",
           "Config", "ConfigError", "DisaggConfig", "DraftModelConfig", "KVCacheConfig", "LibfabricConfig", "MessengerConfig", "ModelConfig",
           "ParallelConfig", "SchedulerConfig", "ServerConfig", "SpeculativeConfig", "_read_yaml", "config_from_dict", "config_to_dict", "load_config", "validate"]
