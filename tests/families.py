"""Small random checkpoints of every family, built with transformers' own classes.

Each case is one transformers config that switches on the options its family exercises (Qwen3's
q/k norms and head_dim != hidden/heads, Gemma 2's soft-capping and alternating windows, Gemma 3's
per-kind RoPE bases and q/k norms, Phi-3's fused projections with partial rotation and LongRoPE).
Windows and LongRoPE's switch are short enough that a test's prompts cross them. Every weight is
random, norms included (a norm of exactly 1 -- or 0 in Gemma's (1 + w) -- hides a wrong formula).
"""

from __future__ import annotations

import os

import torch
import transformers

VOCAB = 211
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, max_position_embeddings=256)

# name -> (transformers config class, model class, overrides)
FAMILIES: dict[str, tuple[type, type, dict]] = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              {"head_dim": 24, "tie_word_embeddings": True, "rope_theta": 1e6}),
    "qwen3-sliding-bias": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                           {"head_dim": 16, "attention_bias": True, "use_sliding_window": True,
                            "sliding_window": 6, "max_window_layers": 2}),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               {"head_dim": 32, "num_hidden_layers": 5, "sliding_window": 6, "sliding_window_pattern": 3,
                "query_pre_attn_scalar": 20, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"rope_theta": 1e4}),
    "phi3-longrope-partial": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
                              {"partial_rotary_factor": 0.75, "max_position_embeddings": 64,
                               "original_max_position_embeddings": 16, "sliding_window": 9,
                               "rope_scaling": {"rope_type": "longrope",
                                                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                                "long_factor": [2.0 + 0.3 * i for i in range(6)]}}),
}


# mixture-of-experts cases (tests/test_moe.py): 8 experts, top-2; Qwen3-MoE with every option its
# class has (bias, a window on every layer, renormalised top-k, head_dim != hidden/heads), OLMoE
# with clip_qkv (which clips here), Mixtral with a window. Expert widths are multiples of 32:
# torch's SiLU rounds a strided input of other widths differently from a contiguous one, and
# transformers applies it to a half of its fused gate_up product (our experts are separate).
MOE = dict(num_experts_per_tok=2, intermediate_size=64, num_hidden_layers=3)
MOE_FAMILIES: dict[str, tuple[type, type, dict]] = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  {**MOE, "num_experts": 8, "moe_intermediate_size": 32, "head_dim": 24,
                   "norm_topk_prob": True, "attention_bias": True, "use_sliding_window": True,
                   "sliding_window": 6, "rope_theta": 1e6}),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              {**MOE, "num_experts": 8, "clip_qkv": 1.5, "router_aux_loss_coef": 0.05}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                {**MOE, "num_local_experts": 8, "sliding_window": 9}),
}
# gpt-oss (tests/test_gpt_oss.py; apart from MOE_FAMILIES, whose tests expect three projections
# per expert): 8 experts top-2, sliding and full layers alternating (window 6), head_dim !=
# hidden/heads, YaRN with a short original context (a ramp over several dimensions), a SwiGLU
# limit and alpha of its own (the limit low enough that both clamps bite on these weights);
# sinks, the router's and experts' biases random like every other weight
GPT_OSS_FAMILIES: dict[str, tuple[type, type, dict]] = {
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                {**MOE, "num_local_experts": 8, "head_dim": 24, "sliding_window": 6,
                 "swiglu_limit": 0.5, "swiglu_alpha": 1.3,
                 "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                     "original_max_position_embeddings": 32}}),
}


# DeepSeek-V3 (tests/test_deepseek_v3.py): 3 layers of latent attention (head_dim 8 rotating,
# 16 not, values 12 wide: all unlike hidden / heads), 8 experts top-2 and shared experts. One case
# with q_lora_rank, interleaved RoPE, YaRN with mscale != mscale_all_dim (both the cos/sin factor
# and the softmax scale move), rms_norm_eps 1e-5 (the latent norms keep 1e-6), a dense first layer
# and 4 groups of which 2 are kept, renormalised; the other with q_proj, pairs (i, i + R/2),
# plain RoPE, q/kv_a/o biases, every layer sparse, one group, no renormalisation, 2 shared experts
DEEPSEEK = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=12, routed_scaling_factor=2.5, rms_norm_eps=1e-5)
DEEPSEEK_FAMILIES: dict[str, tuple[type, type, dict]] = {
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                    {**DEEPSEEK, "q_lora_rank": 24, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
                     "norm_topk_prob": True, "rope_interleave": True, "n_shared_experts": 1,
                     "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.8,
                                         "mscale_all_dim": 0.6, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "rope_theta": 10000.0, "original_max_position_embeddings": 32}}),
    "deepseek_v3-plain": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM,
                          {**DEEPSEEK, "q_lora_rank": None, "first_k_dense_replace": 0, "n_group": 1,
                           "topk_group": 1, "norm_topk_prob": False, "rope_interleave": False,
                           "n_shared_experts": 2, "attention_bias": True,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
}


def random_family_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A transformers model of family case `name` with every weight random, in eval mode, fp32
    (DeepSeek-V3's routers' score-correction biases, buffers there, too)."""
    cfg_cls, model_cls, overrides = {**FAMILIES, **MOE_FAMILIES, **GPT_OSS_FAMILIES, **DEEPSEEK_FAMILIES}[name]
    torch.manual_seed(seed)
    overrides = {k: (dict(v) if isinstance(v, dict) else v) for k, v in overrides.items()}  # transformers mutates them
    hf = model_cls(cfg_cls(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if "gemma" in name else 1.0))
            else:
                p.copy_(0.08 * torch.randn_like(p))
        for bname, buf in hf.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    return hf


def save_family_checkpoint(name: str, path: str | os.PathLike, seed: int = 0, sharded: bool = False,
                           dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """`random_family_model` saved with save_pretrained at `path` (several shards if `sharded`);
    returns the model (in `dtype`)."""
    hf = random_family_model(name, seed).to(dtype)
    hf.save_pretrained(path, **({"max_shard_size": "40KB"} if sharded else {}))
    return hf


def greedy_reference(hf, prompt: list[int], short: list[int], new: int) -> dict[str, list[list[int]]]:
    """transformers' greedy continuations: of `prompt` alone ("single"), and of `prompt` and
    `short` as one left-padded batch ("batch"; LongRoPE picks its factors by the batch's largest
    position, so a batched row may differ from the same row alone)."""
    pad = len(prompt) - len(short)
    ids = torch.tensor([prompt, [0] * pad + short])
    mask = torch.tensor([[1] * len(prompt), [0] * pad + [1] * len(short)])
    with torch.no_grad():
        single = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        batch = hf.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    return {"single": single[:, len(prompt):].tolist(), "batch": batch[:, len(prompt):].tolist()}


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def make_cases(tmp_path_factory, names, prompt: list[int], short: list[int], long_ids: torch.Tensor,
               new: int, atol: float = 1e-5) -> dict[str, "Case"]:
    """One Case per family name, each checkpoint in its own temporary directory (the module-scoped
    `cases` fixture of the family test files)."""
    return {name: Case(name, str(tmp_path_factory.mktemp(name)), prompt, short, long_ids, new, atol)
            for name in names}


def case_prompts(seed: int) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt, short prompt, long teacher-forced ids [2, 21]) for a family test file, from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, VOCAB, (12,), generator=gen).tolist()
    return prompt, prompt[:5], torch.randint(3, VOCAB, (2, 21), generator=gen)


def run_infer(path, prompt: list[int], new: int, tmp_path, capsys, *flags) -> tuple[dict, str]:
    """python -m runners.infer on checkpoint `path`, greedy, `new` tokens past `prompt`, with
    `flags`: (its JSON output, its stderr); a non-zero exit fails with that stderr."""
    import json

    from runners.common import run_main
    from runners.infer import main as infer_main

    out = tmp_path / "out.json"
    rc = run_main(infer_main, [str(a) for a in [
        "--model", path, "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", new,
        "--ignore-eos", "--probe-seconds", "0.05", "--output-json", out, *flags]])
    err = capsys.readouterr().err
    assert rc == 0, err
    return json.loads(out.read_text()), err


class Case:
    """One family case: its checkpoint directory and transformers' model of the same weights,
    checked against on a long teacher-forced batch, a short row, and greedy continuations of
    `prompt` and `short` (transformers' computed once)."""

    def __init__(self, name: str, path: str, prompt: list[int], short: list[int], long_ids: torch.Tensor,
                 new: int, atol: float = 1e-5):
        self.name, self.path = name, path
        self.prompt, self.short, self.long_ids, self.new, self.atol = prompt, short, long_ids, new, atol
        self.hf = save_family_checkpoint(name, path)
        self.hf.generation_config.eos_token_id = None  # generate every token, as ours is asked to
        self._greedy: dict[str, list[list[int]]] | None = None

    def greedy(self) -> dict[str, list[list[int]]]:
        if self._greedy is None:
            self._greedy = self.greedy_of(self.hf)
        return self._greedy

    def greedy_of(self, hf) -> dict[str, list[list[int]]]:
        """Greedy continuations of this case's prompts by `hf` (e.g. over dequantized weights)."""
        return greedy_reference(hf, self.prompt, self.short, self.new)

    def check(self, model, streamer=None, hf=None, tokens: dict | None = None, single: bool = False) -> None:
        """`model`'s logits within atol of transformers' (`hf`, default the case's) on the long
        batch and the short row; its greedy tokens for prompt and short as one left-padded batch
        (and for prompt alone if `single`) equal to transformers' (`tokens`, default the case's)."""
        from offload.infer.generate import generate
        hf = hf if hf is not None else self.hf
        with torch.no_grad():
            for ids in (self.long_ids, torch.tensor([self.short])):
                torch.testing.assert_close(model(ids), hf_logits(hf, ids), rtol=0, atol=self.atol)
            want = tokens if tokens is not None else self.greedy()
            got = generate(model, [self.prompt, self.short], max_new_tokens=self.new, streamer=streamer).tokens
            assert got == want["batch"], self.name
            if single:
                got = generate(model, [self.prompt], max_new_tokens=self.new, streamer=streamer).tokens
                assert got == want["single"], self.name


def dequantized_reference(case: "Case", blocks) -> torch.nn.Module:
    """transformers' model of the case with every projection replaced by our dequantized codes,
    each expert's written into its rows of the fused gate_up_proj / down_proj; the router dense."""
    import copy
    import json
    from pathlib import Path

    from nvme.format import SafetensorsFile
    from offload.models import ModelConfig, block_parameter_shapes
    from offload.models.families import moe_names
    from offload.models.quantized import block_file
    from offload.quant.format import dequantize
    hf = type(case.hf)(copy.deepcopy(case.hf.config)).eval()
    hf.load_state_dict(case.hf.state_dict())
    hf.generation_config.eos_token_id = None
    cfg = ModelConfig.from_hf(json.loads((Path(case.path) / "config.json").read_text()))
    module, (gate, up, down) = moe_names(cfg.architecture)
    I = cfg.moe_intermediate_size
    for i, layer in enumerate(hf.model.layers):
        shapes = block_parameter_shapes(cfg, i)
        with SafetensorsFile(block_file(blocks.path, i)) as f:
            for proj, spec in blocks.specs[i].items():
                parts = {n: f.read(f"{proj}.{n}")
                         for n in ["qweight", "scales"] + (["mins"] if spec.bits == 4 else [])}
                w = dequantize(parts, spec, shapes[f"{proj}.weight"][1], torch.float32)
                with torch.no_grad():
                    if not proj.startswith(f"{module}.experts."):
                        layer.get_submodule(proj).weight.copy_(w)
                        continue
                    _, _, e, p = proj.split(".")
                    fused = layer.mlp.experts
                    target = {gate: fused.gate_up_proj[int(e), :I], up: fused.gate_up_proj[int(e), I:],
                              down: fused.down_proj[int(e)]}[p]
                    target.copy_(w)
    return hf
