"""The decoder of every supported family (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4, and the
mixtures of experts Qwen3-MoE, OLMoE, Mixtral, gpt-oss): config
and presets, the decoder with its KV cache, meta building and block-by-block materialisation,
Hugging Face and GGUF checkpoints in and out."""

from offload.models.config import (ARCHITECTURES, ConfigError, ModelConfig, block_parameter_shapes,
                                   num_active_params, num_block_params, num_params, parameter_shapes,
                                   projection_names)
from offload.models.gguf import GGUFError, GGUFReader, convert_gguf, gguf_checkpoint_dir, is_gguf
from offload.models.hf import (CheckpointError, CheckpointReader, TensorLocation, load_model,
                               save_pretrained)
from offload.models.llama import (DecoderLayer, KVCache, LlamaForCausalLM, build_model,
                                  init_parameter_, kv_cache_bytes, materialize_block,
                                  materialize_non_block, norm_init_value, release_block,
                                  rope_frequencies, seeded_init)
from offload.models.presets import PRESETS, preset
from offload.models.streaming import checkpoint_ranges, load_streamed

__all__ = [
    "ARCHITECTURES", "PRESETS", "ConfigError", "ModelConfig", "block_parameter_shapes",
    "num_active_params", "num_block_params", "num_params", "parameter_shapes", "preset",
    "projection_names",
    "GGUFError", "GGUFReader", "convert_gguf", "gguf_checkpoint_dir", "is_gguf",
    "CheckpointError", "CheckpointReader", "TensorLocation", "load_model", "save_pretrained",
    "DecoderLayer", "KVCache", "LlamaForCausalLM", "build_model", "init_parameter_",
    "kv_cache_bytes", "materialize_block", "materialize_non_block", "norm_init_value",
    "release_block", "rope_frequencies", "seeded_init", "checkpoint_ranges", "load_streamed",
]
