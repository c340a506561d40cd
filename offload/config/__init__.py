"""The configuration: one typed, validated OffloadConfig, built from arguments, a flat dict, a
DeepSpeed dict or a JSON file.

  values.py     sizes, dtypes, placements, reading a config file safely, ConfigError
  deepspeed.py  a DeepSpeed dict as OffloadConfig's fields (every key honoured, named or refused)
  options.py    OffloadConfig, the rules about which options go together, from_deepspeed,
                load_config_file
"""

from offload.config.deepspeed import DEEPSPEED_INERT, DEEPSPEED_TOP_KEYS, AutoValues
from offload.config.options import (COMBINATION_RULES, MAX_CONFIG_FILE_BYTES, CombinationRule,
                                    OffloadConfig, as_config, combination_error, config_file_fields,
                                    from_deepspeed, load_config_file)
from offload.config.values import (DTYPES, PLACEMENTS, ConfigError, DtypeName, GradStorageName,
                                   Placement, StepPathName, dtype_name, format_bytes, parse_bytes,
                                   read_regular_file)

__all__ = ["OffloadConfig", "ConfigError", "CombinationRule", "COMBINATION_RULES",
           "combination_error", "as_config", "from_deepspeed", "load_config_file", "config_file_fields",
           "AutoValues",
           "DEEPSPEED_INERT", "DEEPSPEED_TOP_KEYS", "MAX_CONFIG_FILE_BYTES", "parse_bytes",
           "format_bytes", "DTYPES", "DtypeName", "Placement", "PLACEMENTS", "StepPathName",
           "GradStorageName", "dtype_name", "read_regular_file"]
