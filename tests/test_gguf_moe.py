"""GGUF files of mixtures of experts in: Qwen3-MoE (`qwen3moe`), OLMoE (`olmoe`) and Mixtral (llama.cpp's
`llama` architecture with expert tensors). Small random transformers checkpoints (tests/families.py
MOE_FAMILIES: 8 experts, top-2) are written the way llama.cpp's converter writes them -- its names,
each layer's experts stacked into 3-D `ffn_{gate,up,down}_exps` tensors, the router as `ffn_gate_inp`,
Mixtral's q/k rows interleaved, its metadata keys -- in F32, Q8_0 and (rows of 256) Q4_K; converted
once into a Hugging Face directory (gguf_checkpoint_dir), which holds exactly the dequantized values
split expert by expert, loads in the project and gives the logits of transformers carrying those
values (fp32, within 1e-5) and its greedy tokens; the runner infers from such a file with int8
experts; each expert is a byte range of its 3-D tensor, dequantized on its own; a fused gate_up
expert tensor reads as the two; what is not built is refused in one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from families import MOE_FAMILIES, SMALL, VOCAB  # noqa: E402
from offload.models import CheckpointReader, load_model  # noqa: E402
from offload.models.config import parameter_shapes  # noqa: E402
from offload.models.families import moe_names  # noqa: E402
from offload.models.gguf import GGUFError, GGUFReader, gguf_checkpoint_dir  # noqa: E402
from offload.models.gguf_names import expected_shapes  # noqa: E402

ARCH = {"qwen3_moe": "qwen3moe", "olmoe": "olmoe", "mixtral": "llama"}
# what llama.cpp's graphs of these architectures express: no sliding window (qwen3moe, llama),
# qwen3moe's top-k renormalised, OLMoE's not (its families case already is so)
GGUF_CASE = {"qwen3_moe": {"use_sliding_window": False, "sliding_window": None},
             "olmoe": {}, "mixtral": {"sliding_window": None}}
# rows of 256 values for the K-quant: hidden and expert widths of 256 (a wider, 2-layer Qwen3-MoE);
# o_proj's rows (4 heads x 32) are not, so it is Q8_0: a file of mixed types, as Q4_K_M files are
K_CASE = {"hidden_size": 256, "head_dim": 32, "moe_intermediate_size": 256, "num_hidden_layers": 2}
CASES = [("qwen3_moe", "F32"), ("olmoe", "F32"), ("mixtral", "F32"),
         ("qwen3_moe", "Q8_0"), ("olmoe", "Q8_0"), ("mixtral", "Q8_0"), ("qwen3_moe", "Q4_K")]
NEW = 5
SMALL_LAYERS = MOE_FAMILIES["mixtral"][2]["num_hidden_layers"]
_gen = torch.Generator().manual_seed(97)
PROMPT = torch.randint(3, VOCAB, (10,), generator=_gen).tolist()
SHORT = PROMPT[:4]
LONG_IDS = torch.randint(3, VOCAB, (2, 17), generator=_gen)
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0


def moe_model(family: str, extra: dict | None = None, seed: int = 0):
    """A transformers model of MOE_FAMILIES[family] as llama.cpp can express it, every weight random."""
    cfg_cls, model_cls, overrides = MOE_FAMILIES[family]
    torch.manual_seed(seed)
    hf = model_cls(cfg_cls(**{**SMALL, **overrides, **GGUF_CASE[family], **(extra or {})})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) + 1.0 if "norm" in name else 0.08 * torch.randn_like(p))
    return hf


# ---- writing a model as llama.cpp's converter does --------------------------------------------------
def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation of Llama q/k rows (each head's two rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_order(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(kind, shape, rng) -> np.ndarray:
    """Random valid blocks of K type `kind` (d and dmin small, the rest any byte) for a tensor of
    torch `shape` (gguf-py cannot quantize K types)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for at in (0, 2):  # Q4_K: d, dmin (float16), then scales and codes
        raw[..., at:at + 2] = rng.uniform(-2e-4, 2e-4, raw.shape[:-1]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def _store(w: np.ndarray, qtype: str, rng):
    """(data as stored, its type): a matrix in `qtype` where its rows are whole blocks of it (Q8_0
    where they are not), vectors and routers in F32 (llama.cpp keeps ffn_gate_inp in F32)."""
    kind = gguf.GGMLQuantizationType[qtype]
    if w.ndim == 1 or qtype == "F32":
        return w, F32
    if w.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
        kind = Q8_0
    if kind.name.endswith("_K"):
        return _random_k_blocks(kind, w.shape, rng), kind
    return gguf.quants.quantize(w, kind), kind


def gguf_tensors(family: str, hf, qtype: str, root, seed: int = 0) -> tuple[dict, dict]:
    """({gguf name: (data, type)}, {our name: the float32 values a correct reader gives}) of `hf`,
    whose tensors are read as its save_pretrained writes them (one per expert)."""
    from safetensors.numpy import load_file
    rng = np.random.default_rng(seed)
    cfg = hf.config
    hf.save_pretrained(root)
    sd = load_file(str(root / "model.safetensors"))
    module, (gate, up, down) = moe_names(hf.__class__.__name__)
    heads = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
    tensors, expected = {}, {}

    def put(gguf_name, w, ours):  # ours: [our name] of w, or [our names] of its experts
        data, kind = _store(w, "F32" if gguf_name.endswith("ffn_gate_inp.weight") else qtype, rng)
        tensors[gguf_name] = (data, kind)
        values = np.asarray(gguf.quants.dequantize(data, kind), dtype=np.float32).reshape(w.shape)
        m = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if family == "mixtral" and m in ("attn_q", "attn_k"):
            values = _hf_order(values, heads[m[-1]])
        for i, name in enumerate(ours):
            expected[name] = values[i] if len(ours) > 1 else values
    put("token_embd.weight", sd["model.embed_tokens.weight"], ["model.embed_tokens.weight"])
    put("output_norm.weight", sd["model.norm.weight"], ["model.norm.weight"])
    put("output.weight", sd["lm_head.weight"], ["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                             ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                             ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
                             ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                             (f"{module}.gate", "ffn_gate_inp")):
            for suffix in ("weight", "bias"):
                if f"{p}{ours}.{suffix}" in sd:
                    w = sd[f"{p}{ours}.{suffix}"]
                    if family == "mixtral" and theirs in ("attn_q", "attn_k"):
                        w = _interleave(w, heads[theirs[-1]])
                    put(f"{b}{theirs}.{suffix}", w, [f"{p}{ours}.{suffix}"])
        for proj, theirs in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps"), (down, "ffn_down_exps")):
            names = [f"{p}{module}.experts.{e}.{proj}.weight" for e in range(_experts(cfg))]
            put(f"{b}{theirs}.weight", np.stack([sd[n] for n in names]), names)
    assert set(expected) == set(sd), set(sd) ^ set(expected)
    return tensors, expected


def _experts(cfg) -> int:
    return getattr(cfg, "num_local_experts", None) or cfg.num_experts


def gguf_metadata(family: str, cfg) -> dict:
    """The metadata llama.cpp's converter writes for `cfg` (keys without the architecture prefix)."""
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    meta = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads,
            "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps), "rope.freq_base": float(theta),
            "vocab_size": cfg.vocab_size, "expert_count": _experts(cfg),
            "expert_used_count": cfg.num_experts_per_tok}
    if family == "qwen3_moe":
        meta.update({"attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
                     "expert_feed_forward_length": cfg.moe_intermediate_size})
    if family == "olmoe" and cfg.clip_qkv is not None:
        meta["attention.clamp_kqv"] = float(cfg.clip_qkv)
    return meta


def write_gguf(path, arch: str, meta: dict, tensors: dict) -> None:
    """A GGUF of `arch` with `meta` (None values left out), a byte-level vocabulary of VOCAB
    single characters (so it converts and runs) and `tensors` ({name: (data, type)})."""
    from tokenizers import pre_tokenizers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet())[:VOCAB])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    for key, value in meta.items():
        if value is None:
            continue
        add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32}[type(value)]
        add(f"{arch}.{key}", value)
    for name, (data, kind) in tensors.items():
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_greedy(hf, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations of `prompts` as one left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


class Built:
    """One case: the GGUF file, the values it must read as, and transformers carrying them."""

    def __init__(self, family: str, qtype: str, root):
        self.family, self.qtype = family, qtype
        src = moe_model(family, K_CASE if qtype.endswith("_K") else None)
        self.tensors, self.expected = gguf_tensors(family, src, qtype, root / f"{family}-{qtype}-source")
        self.path = root / f"{family}-{qtype}.gguf"
        write_gguf(self.path, ARCH[family], gguf_metadata(family, src.config), self.tensors)
        ref_dir = root / f"{family}-{qtype}-reference"
        src.config.save_pretrained(ref_dir)  # the dequantized values under transformers' own names
        from safetensors.torch import save_file
        save_file({n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in self.expected.items()},
                  str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
        self.ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        self.ref.generation_config.eos_token_id = None
        self.src_config = src.config


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-gguf")
    cache: dict[tuple[str, str], Built] = {}

    def get(family: str, qtype: str) -> Built:
        if (family, qtype) not in cache:
            cache[family, qtype] = Built(family, qtype, root)
        return cache[family, qtype]
    return get


# ---- conversion against transformers ------------------------------------------------------------------
@pytest.mark.parametrize("family,qtype", CASES, ids=[f"{f}-{q}" for f, q in CASES])
def test_converted_moe_gguf_equals_transformers_with_the_dequantized_weights(built, family, qtype, tmp_path):
    case = built(family, qtype)
    with GGUFReader(str(case.path)) as reader:
        cfg, src = reader.config, case.src_config
        assert cfg.architecture == case.ref.__class__.__name__ and reader.unexpected == []
        head_dim = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim) == (_experts(src), 2, head_dim)
        assert cfg.norm_topk_prob == (family != "olmoe") and cfg.sliding_window is None
        assert cfg.moe_intermediate_size == getattr(src, "moe_intermediate_size", src.intermediate_size)
        assert cfg.clip_qkv == (src.clip_qkv if family == "olmoe" else None)
        types = {t.tensor_type.name for t in reader.tensors.values()}
        assert types == ({"F32"} if qtype == "F32" else {"F32", qtype} | ({"Q8_0"} if qtype == "Q4_K" else set()))
        assert parameter_shapes(cfg) == expected_shapes(reader.arch, reader.hf_config, reader.tensors)
    out = gguf_checkpoint_dir(str(case.path), torch.float32, str(tmp_path / "cache"))
    with CheckpointReader(out) as r:  # each expert's matrix, exactly the file's values in HF's order
        assert sorted(r.locations) == sorted(case.expected)
        for name, want in case.expected.items():
            assert torch.equal(r.read(name), torch.from_numpy(want)), name
    model = load_model(out)
    from offload.infer.generate import generate
    with torch.no_grad():
        for ids in (LONG_IDS, torch.tensor([SHORT])):
            torch.testing.assert_close(model(ids), case.ref(ids).logits, rtol=0, atol=1e-5)
    assert generate(model, [PROMPT, SHORT], max_new_tokens=NEW).tokens == hf_greedy(case.ref, [PROMPT, SHORT])


def test_expert_slices_are_byte_ranges_of_the_stacked_tensor(built):
    """Each expert's matrix is its own rows of the 3-D tensor's mapping (no copy, whole K blocks),
    dequantized on its own bit-equal to the package dequantizing the whole tensor."""
    case = built("qwen3_moe", "Q4_K")
    with GGUFReader(str(case.path)) as reader:
        stacked = reader._by_gguf["blk.1.ffn_down_exps.weight"]
        assert stacked.tensor_type.name == "Q4_K" and len(stacked.data.shape) == 3
        whole = gguf.quants.dequantize(np.asarray(stacked.data), stacked.tensor_type)
        for e in range(8):
            t = reader.tensors[f"model.layers.1.mlp.experts.{e}.down_proj.weight"]
            assert np.shares_memory(t.data, stacked.data) and t.data.flags.c_contiguous
            assert t.data.nbytes == stacked.data.nbytes // 8
            np.testing.assert_array_equal(reader.read_array(f"model.layers.1.mlp.experts.{e}.down_proj.weight"),
                                          whole[e])


def test_a_fused_gate_up_expert_tensor_reads_as_gate_and_up(built, tmp_path):
    """llama.cpp's `--fuse-gate-up-exps` stores each expert's gate rows then its up rows in one
    `ffn_gate_up_exps` tensor: read as the same two matrices as the separate tensors."""
    case = built("mixtral", "Q8_0")
    tensors = dict(case.tensors)
    for i in range(SMALL_LAYERS):
        (g, kind), (u, _) = tensors.pop(f"blk.{i}.ffn_gate_exps.weight"), tensors.pop(f"blk.{i}.ffn_up_exps.weight")
        tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = (np.concatenate([g, u], axis=1), kind)
    path = tmp_path / "fused.gguf"
    write_gguf(path, "llama", gguf_metadata("mixtral", case.src_config), tensors)
    with GGUFReader(str(path)) as fused, GGUFReader(str(case.path)) as separate:
        assert sorted(fused.tensors) == sorted(separate.tensors) and fused.unexpected == []
        for name in fused.tensors:
            np.testing.assert_array_equal(fused.read_array(name), separate.read_array(name), err_msg=name)
        assert "(expert 3, rows 64-127)" in fused.tensors["model.layers.0.block_sparse_moe.experts.3.w3.weight"].name



@pytest.mark.parametrize("qtype,mode", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_runner_infers_from_a_moe_gguf_with_quantized_experts(built, qtype, mode, tmp_path, monkeypatch, capsys):
    """python -m runners.infer --quantize int8 / int4 on a Q8_0 / Q4_0 Mixtral GGUF: each expert's
    blocks taken as the file stores them (the router kept dense): transformers' greedy tokens
    over the file's values, and the cache holding the file's own codes and scales."""
    from runners.common import run_main
    from runners.infer import main as infer_main
    case = built("mixtral", qtype)
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path / "gguf"))
    out = tmp_path / "out.json"
    rc = run_main(infer_main, [str(a) for a in [
        "--model", case.path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", NEW,
        "--quantize", mode, "--ignore-eos", "--probe-seconds", "0.05", "--offload-dir", tmp_path / "off",
        "--output-json", out]])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "MixtralForCausalLM" in err
    assert json.loads(out.read_text())["generated_ids"] == hf_greedy(case.ref, [PROMPT])
    # each expert's blocks taken as the file stores them: the cache holds its codes and scales
    from nvme.format import SafetensorsFile
    from offload.quant.format import from_gguf
    [block0] = (tmp_path / "off" / "quant").glob("*/block_00000.safetensors")
    with GGUFReader(case.path) as g, SafetensorsFile(block0) as f:
        t = g.tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
        assert t.tensor_type.name == qtype
        _, parts = from_gguf(t.tensor_type.name, t.data, tuple(int(d) for d in reversed(list(t.shape))))
        for part, want in parts.items():
            assert torch.equal(f.read(f"block_sparse_moe.experts.3.w2.{part}"), want), part


# ---- refused in one line --------------------------------------------------------------------------------
def _drop(prefix):
    return lambda t, m: [t.pop(n) for n in [n for n in t if n.startswith(prefix)]]


def _dense_layer(t, m):
    """Block 1's experts and router replaced by a dense MLP (Qwen3-MoE's mlp_only_layers)."""
    for n in [n for n in t if n.startswith("blk.1.ffn_") and n != "blk.1.ffn_norm.weight"]:
        del t[n]
    for kind, shape in (("gate", (64, 64)), ("up", (64, 64)), ("down", (64, 64))):
        t[f"blk.1.ffn_{kind}.weight"] = (np.zeros(shape, np.float32), F32)


REFUSED = {
    "shared expert": ("qwen3_moe", lambda t, m: t.update({"blk.0.ffn_up_shexp.weight": (np.zeros((32, 64), np.float32), F32)}),
                      r"tensor blk\.0\.ffn_up_shexp\.weight is a shared expert .* not built"),
    "shared expert count": ("qwen3_moe", lambda t, m: m.update(expert_shared_count=1),
                            r"qwen3moe\.expert_shared_count = 1 \(shared experts\) is not supported"),
    "sigmoid routing": ("qwen3_moe", lambda t, m: m.update(expert_gating_func=2),
                        r"qwen3moe\.expert_gating_func = 2 \(routing other than softmax\) is not supported"),
    "scaled routing": ("olmoe", lambda t, m: m.update(expert_weights_scale=2.5),
                       r"olmoe\.expert_weights_scale = 2\.5 \(scaled routing weights\) is not supported"),
    "dense layers": ("qwen3_moe", lambda t, m: m.update(leading_dense_block_count=1),
                     r"leading_dense_block_count = 1 \(dense layers before the sparse ones\) is not supported"),
    "a dense layer": ("qwen3_moe", _dense_layer,
                      r"block 1 has a dense MLP \(blk\.1\.ffn_\w+\.weight\) in an MoE file: dense layers"),
    "expert count": ("olmoe", lambda t, m: m.update(expert_count=6),
                     r"expert tensor blk\.0\.ffn_\w+_exps\.weight holds 8 experts where olmoe\.expert_count says 6"),
    "no expert count": ("mixtral", lambda t, m: m.update(expert_count=None),
                        r"metadata llama\.expert_count = None is not a positive integer"),
    "used > count": ("mixtral", lambda t, m: m.update(expert_used_count=9),
                     r"llama\.expert_used_count = 9 is more than its 8 experts"),
    "expert shape": ("mixtral", lambda t, m: t.update({"blk.2.ffn_down_exps.weight": (np.zeros((8, 64, 32), np.float32), F32)}),
                     r"expert tensor blk\.2\.ffn_down_exps\.weight has shape \[8, 64, 32\], the metadata implies \[8, 64, 64\]"),
    "router rows": ("qwen3_moe", lambda t, m: t.update({"blk.0.ffn_gate_inp.weight": (np.zeros((6, 64), np.float32), F32)}),
                    r"tensor blk\.0\.ffn_gate_inp\.weight has shape \[6, 64\], the metadata implies \[8, 64\]"),
    "missing expert": ("olmoe", _drop("blk.2.ffn_up_exps"),
                       r"tensor for 'model\.layers\.2\.mlp\.experts\.0\.up_proj\.weight' is missing"),
    "old Mixtral layout": ("mixtral", lambda t, m: t.update({"blk.0.ffn_gate.0.weight": (np.zeros((64, 64), np.float32), F32)}),
                           r"tensor blk\.0\.ffn_gate\.0\.weight is one expert stored on its own .* convert the model again"),
    "router bias": ("olmoe", lambda t, m: t.update({"blk.0.ffn_gate_inp.bias": (np.zeros(8, np.float32), F32)}),
                    r"tensor blk\.0\.ffn_gate_inp\.bias \(an expert or router tensor"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_what_is_not_built_is_refused_in_one_line(built, tmp_path, what):
    family, change, needle = REFUSED[what]
    case = built(family, "F32")
    tensors, meta = dict(case.tensors), gguf_metadata(family, case.src_config)
    change(tensors, meta)
    path = tmp_path / "bad.gguf"
    write_gguf(path, ARCH[family], meta, tensors)
    with pytest.raises(GGUFError, match=needle) as e:
        GGUFReader(str(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_expert_tensors_outside_the_moe_architectures_are_refused(built, tmp_path):
    """Experts in a dense architecture's file (qwen3, mistral), and MoE architectures not built
    (qwen2moe's shared experts, deepseek2), each in one line."""
    case = built("qwen3_moe", "F32")
    meta = gguf_metadata("qwen3_moe", case.src_config)
    for arch, needle in (("qwen3", "a qwen3 file with expert tensors is not supported"),
                         ("mistral", "a mistral file with expert tensors is not supported"),
                         ("qwen2moe", "architecture 'qwen2moe' is not supported"),
                         ("deepseek2", "architecture 'deepseek2' is not supported")):
        path = tmp_path / f"{arch}.gguf"
        write_gguf(path, arch, meta, case.tensors)
        with pytest.raises(GGUFError, match=needle) as e:
            GGUFReader(str(path))
        assert "\n" not in str(e.value)
    assert os.path.isfile(case.path)
