"""Tiny random models built from transformers' own config classes, saved as safetensors."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.common, as a plain `pytest` run finds it
from bench.common import save_calib_tokenizer  # noqa: E402

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
# equivalence tests compare float32 runtimes with transformers to 1e-4 of the logits: LoRC rebuilds its keys in
# float32 here, whatever this CPU multiplies faster (the bfloat16 rebuild has its own tests, test_lorc.py)
os.environ.setdefault("KVCONVERT_REBUILD", "exact")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # `make test` runs the suite in one worker per core (pytest-xdist): most tests are Python-bound on tiny models,
    # so each worker keeps its share of the cores rather than every worker's BLAS threads contending for all of them;
    # the CLI subprocesses tests start inherit the same share, and so does Inductor's pool of C++ compile workers:
    # on a fresh machine (CI) every compiled-decode test compiles its kernels cold, a minute or more each on 2 cores
    _threads = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = _threads
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", _threads)
    torch.set_num_threads(int(_threads))
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU; read when the kernels are decorated (import time)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _eager_cpu_readers(request, monkeypatch):
    """kvconvert's own compiled CPU readers cost Inductor 10-20 s a graph, and every bit width, batch of one and absent
    sink or tail is a graph of its own: built at first use, 7 of the suite's 19 minutes; under ``auto`` a worker would
    build them once it had decoded 5 minutes, at a test that happened to be running. Tests read through the eager ops,
    which test_fused_readers.py (marked ``compiled_readers``: the setting left to it) proves the compiled readers
    equal; a decode step a test compiles itself never calls them (``fuses``)."""
    if request.node.get_closest_marker("compiled_readers") is None:
        monkeypatch.setenv("KVCONVERT_COMPILE", "off")


def tiny_config(kind: str):
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=97, num_hidden_layers=3, max_position_embeddings=256)
    if kind == "llama":
        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, **common
        )
    if kind == "llama_bias":  # attention_bias=True: q/k/v/o biases with RoPE
        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
            attention_bias=True, **common,
        )  # fmt: skip
    if kind == "llama_wide":  # head_dim·heads = 96 > hidden 64: non-square W_K (paper §5 option 1)
        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=24, **common
        )
    if kind == "llama_gqa":
        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **common
        )
    if kind == "llama_mqa":  # one KV head (what DeepSeek-V3's shared RoPE key holds exactly), tied output head
        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
            tie_word_embeddings=True, **common,
        )  # fmt: skip
    if kind == "llama_kv1024":  # 1024 cached values per token and layer: more than vLLM's MLA size (512 + 64)
        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=8, head_dim=64, **common
        )
    if kind == "llama_gqa64":  # head width 64: what the token layout's int4 rows need (a multiple of 32)
        return LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, **common
        )
    if kind == "qwen2_gqa":  # GQA with q/k/v biases
        return Qwen2Config(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **common
        )
    if kind == "mistral":
        return MistralConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=16, **common
        )
    if kind == "qwen2":  # q/k/v biases, no o bias
        return Qwen2Config(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4, **common
        )
    if kind == "gpt_neox":  # fused QKV, partial rotary (25 %), biases
        return GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, **common)
    if kind == "gpt2":
        return GPT2Config(n_embd=64, n_head=4, n_layer=3, n_positions=256, vocab_size=97)
    return _family_config(kind, common)


def _family_config(kind: str, common: dict):
    """The families added since 2024: QK-norm, interleaved sliding-window layers, soft-capping, fused QKV."""
    from transformers import Gemma2Config, Gemma3TextConfig, Olmo2Config, Phi3Config, Qwen3Config

    heads = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)
    # windows of 8 tokens: the 24-token prompts and 32 decode steps of the tests slide past them
    interleaved = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    special = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen3":  # QK-norm per head, GQA
        return Qwen3Config(num_key_value_heads=2, **heads, **common, **special)
    if kind == "qwen3_mha":  # QK-norm per head, one KV head per query head (what slim converts)
        return Qwen3Config(num_key_value_heads=4, **heads, **common, **special)
    if kind == "qwen3_sliding":  # QK-norm and sliding layers above max_window_layers
        return Qwen3Config(num_key_value_heads=2, use_sliding_window=True, max_window_layers=1, sliding_window=8,
                           **heads, **common, **special)  # fmt: skip
    if kind == "qwen3_moe":  # QK-norm per head, MoE MLP
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                              **heads, **common, **special)  # fmt: skip
    if kind == "olmo2":  # QK-norm over all heads at once
        return Olmo2Config(num_key_value_heads=4, **{k: v for k, v in heads.items() if k != "head_dim"}, **common,
                           **special)  # fmt: skip
    if kind == "gemma3":  # QK-norm, local/global layers with their own RoPE tables, MQA, scaled queries
        return Gemma3TextConfig(num_key_value_heads=1, query_pre_attn_scalar=24, **heads, **interleaved, **common,
                                **special)  # fmt: skip
    if kind == "gemma3_64":  # the same, head width 64: what the token layout's int4 rows need (a multiple of 32)
        return Gemma3TextConfig(num_key_value_heads=1, query_pre_attn_scalar=24, **{**heads, "head_dim": 64},
                                **interleaved, **common, **special)  # fmt: skip
    if kind == "gemma2":  # soft-capped logits, local/global layers
        return Gemma2Config(num_key_value_heads=2, query_pre_attn_scalar=24, attn_logit_softcapping=20.0, **heads,
                            **interleaved, **common, **special)  # fmt: skip
    if kind == "llama3_rope":  # Llama 3.1's RoPE frequency scaling (MHA, so that slim applies too)
        from transformers import LlamaConfig

        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
        return LlamaConfig(num_key_value_heads=4, rope_parameters=rope, **heads, **common, **special)
    if kind == "mixtral":  # sparse MoE MLP, Mistral attention
        from transformers import MixtralConfig

        return MixtralConfig(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1, **heads, **common,
                             **special)  # fmt: skip
    if kind == "qwen2_moe":  # MoE with q/k/v biases
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, **heads, **common, **special)  # fmt: skip
    if kind == "phi3":  # one fused qkv_proj, MHA
        return Phi3Config(num_key_value_heads=4, **{k: v for k, v in heads.items() if k != "head_dim"}, **common,
                          **special)  # fmt: skip
    return _llama_attention_config(kind, common, heads, interleaved, special)


def _llama_attention_config(kind: str, common: dict, heads: dict, interleaved: dict, special: dict):
    """Families whose attention is Llama's or Qwen3's / OLMo 2's under another name (arch/llama.py says which)."""
    import transformers

    gqa = dict(num_key_value_heads=2, **heads, **common, **special)
    if kind == "gemma":  # Gemma 1: MQA, a (1 + w) RMSNorm and scaled embeddings around stock attention
        return transformers.GemmaConfig(**{**gqa, "num_key_value_heads": 1})
    if kind == "granite":  # scores scaled by attention_multiplier, not head_dim^-1/2
        return transformers.GraniteConfig(attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5,
                                          logits_scaling=2.0, **gqa)  # fmt: skip
    if kind == "starcoder2":  # q/k/v/o biases, LayerNorms, MHA
        return transformers.Starcoder2Config(use_bias=True, **{**gqa, "num_key_value_heads": 4})
    if kind == "seed_oss":  # q/k/v and o biases
        return transformers.SeedOssConfig(attention_bias=True, attention_out_bias=True, **gqa)
    if kind == "olmo3":  # OLMo 2's QK-norm over all heads, sliding layers between global ones
        return transformers.Olmo3Config(**{**gqa, "num_key_value_heads": 4}, **interleaved)
    if kind == "granitemoe":  # Granite's scaled attention beside a sparse MoE MLP
        return transformers.GraniteMoeConfig(attention_multiplier=0.3, num_local_experts=2, num_experts_per_tok=1,
                                             **gqa)  # fmt: skip
    if kind == "cohere2":  # interleaved RoPE in the sliding layers only, none in the global one
        return transformers.Cohere2Config(**gqa, **interleaved)
    if kind == "smollm3":  # Llama's attention, RoPE skipped in every fourth layer (here: the middle one of three)
        return transformers.SmolLM3Config(no_rope_layers=[1, 0, 1], **gqa)
    if kind == "smollm3_mha":  # the same with one KV head per query head (what slim converts)
        return transformers.SmolLM3Config(no_rope_layers=[1, 0, 1], **{**gqa, "num_key_value_heads": 4})
    configs = {"arcee": transformers.ArceeConfig, "apertus": transformers.ApertusConfig,
               "helium": transformers.HeliumConfig, "cohere": transformers.CohereConfig,
               "glm": transformers.GlmConfig, "glm4": transformers.Glm4Config,
               "ernie4_5": transformers.Ernie4_5Config}  # fmt: skip
    if kind in configs:  # Llama's attention (Apertus: Qwen3's QK-norm) beside another MLP or norm
        return configs[kind](**gqa)
    raise ValueError(kind)


def build_tiny_model(kind: str, seed: int = 0):
    """A random model whose biases are non-zero (transformers initialises them to zero, which
    would leave the bias folding untested) and whose weights are large enough to give
    non-trivial attention patterns."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif param.ndim == 2 and "emb" not in name and "wte" not in name and "wpe" not in name:
                param.normal_(0.0, 0.15)
    return model.eval()


def _model_dir_factory(tmp_path_factory, prefix: str, with_tokenizer: bool):
    """kind -> directory of a tiny random model (+ tokenizer), each kind built once per session."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            path = tmp_path_factory.mktemp(f"{prefix}-{kind}")
            build_tiny_model(kind).save_pretrained(path)
            if with_tokenizer:
                save_tiny_tokenizer(path)
            made[kind] = path
        return made[kind]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: kind -> directory with config.json + model.safetensors of a tiny random model."""
    return _model_dir_factory(tmp_path_factory, "src", with_tokenizer=False)


@pytest.fixture(scope="session")
def aidreams_dir(tmp_path_factory):
    checkpoint = SHARED / "models" / "aidreams260K" / "aidreams260K.bin"
    if not checkpoint.exists():
        pytest.skip("../shared/models/aidreams260K is not present")
    from kvconvert.io.llama2c import import_llama2c

    out = tmp_path_factory.mktemp("aidreams") / "hf"
    import_llama2c(checkpoint, out, tokenizer=checkpoint.parent / "tok512.bin")
    return out


CALIB_DATA = Path(__file__).resolve().parents[1] / "kvconvert" / "calib_data"


def save_tiny_tokenizer(path: Path, vocab_size: int = 97) -> None:
    """A BPE tokenizer trained on calib_data/ with the tiny models' vocabulary size, so that commands needing a
    tokenizer (calibration) run on tiny random models (the benchmarks' random models use the same one)."""
    save_calib_tokenizer(path, vocab_size)


@pytest.fixture(scope="session")
def tokenized_model_dir(tmp_path_factory):
    """Factory: kind -> tiny random model directory that also holds a tokenizer."""
    return _model_dir_factory(tmp_path_factory, "tok", with_tokenizer=True)


@pytest.fixture(scope="session")
def converted(tokenized_model_dir, tmp_path_factory):
    """Factory: (method, table) -> (source dir, output dir), ``table`` one of ``tests/default_methods.py``'s
    (``LOSSLESS``, ``COMPRESSING``); each converted once per session through the CLI."""
    from default_methods import COMPRESSING, LOSSLESS
    from helpers import convert

    tables = {"lossless": LOSSLESS, "compressing": COMPRESSING}
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(method: str, table: str) -> tuple[Path, Path]:
        if (method, table) not in made:
            kind, extra = tables[table][method]
            src, out = tokenized_model_dir(kind), tmp_path_factory.mktemp(f"{method}-{table}") / "out"
            convert(method, src, out, *extra)
            made[method, table] = (src, out)
        return made[method, table]

    return make
