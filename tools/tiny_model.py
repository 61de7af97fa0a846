"""A tiny Llama checkpoint with random weights and an offline-trained tokenizer.

vLLM loads it like any Hugging Face model, so the end-to-end tests and the
two-engine demo need no downloads. Head size 32 is the smallest the CPU
attention kernels accept; 2 KV heads make it GQA.

A development tool, not part of the installed package: import it from the
repository root as ``tools.tiny_model`` (``python -m kvcached.serve_demo`` and
pytest, run from the root, do).
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Elastic KV caches map memory only for blocks that hold tokens.",
    "Two engines can share one device when memory follows load.",
    "Paged attention reads keys and values block by block.",
    "Once upon a time there was a small model with random weights.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16.",
] * 20


def make_tiny_llama(path: str | Path, *, seed: int = 0, vocab_size: int = 384, hidden_size: int = 128,
                    num_heads: int = 4, num_kv_heads: int = 2, num_layers: int = 2,
                    sliding_window: int | None = None) -> Path:
    """Write config, random weights and tokenizer to ``path``; returns it.

    ``sliding_window``: every other layer (the even ones) attends to that many tokens only, as
    ``layer_types`` declares it (gpt-oss, Gemma 2/3 style): vLLM then forms two KV cache groups.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    if sliding_window is not None:
        config.sliding_window = sliding_window
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return _save_random(LlamaForCausalLM, config, path, seed)


def _save_random(model_cls: type, config: object, path: Path, seed: int, drop: tuple[str, ...] = ()) -> Path:
    """Random float32 weights of ``model_cls(config)`` saved at ``path``; ``drop``: config keys to leave out."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # Larger weights than the default init make the logits peaked enough that
    # greedy decoding is stable and differs between prompts.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["torch_dtype"] = "float32"
    for key in drop:
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def make_tiny_mamba_hybrid(path: str | Path, *, seed: int = 0, attention_first: bool = False) -> Path:
    """Mamba2 and attention layers in turn (a dense Granite-4.0-H), random weights, the same tokenizer.

    vLLM forms a Mamba group and an attention group and pads each Mamba state page up to the
    attention page, so the two share kvcached's slots. Layers: 0 and 2 Mamba2, 1 and 3 attention
    (``attention_first``: the other way round).
    """
    import transformers
    from packaging.version import Version
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    # transformers 5.13 renamed the layer types; an older one takes an unknown name for attention
    new_names = Version(transformers.__version__) >= Version("5.13")
    layer_types = ["linear_attention", "full_attention"] if new_names else ["mamba", "attention"]
    if attention_first:
        layer_types.reverse()

    path = Path(path)
    make_tiny_llama(path, seed=seed)  # the tokenizer (its Llama weights are replaced below)
    for stale in path.glob("*.safetensors"):
        stale.unlink()
    llama = json.loads((path / "config.json").read_text())
    config = GraniteMoeHybridConfig(
        vocab_size=llama["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=llama["bos_token_id"], eos_token_id=llama["eos_token_id"], pad_token_id=None,
        tie_word_embeddings=False, layer_types=layer_types * 2,
        num_local_experts=0, num_experts_per_tok=0, shared_intermediate_size=256, position_embedding_type="rope",
        mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=64,
    )
    # time_step_limit (0, inf): JSON has no infinity, and it is the default anyway
    return _save_random(GraniteMoeHybridForCausalLM, config, path, seed, drop=("time_step_limit",))


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_shape_only_model(path: str | Path, config: dict) -> Path:
    """A checkpoint folder of ``config`` (a Hugging Face config.json) without weights, for
    ``load_format="dummy"``, and a tokenizer whose vocabulary is the config's.

    The tokenizer encodes text byte by byte (no merges) and decodes any id of the model's
    vocabulary (ids past the bytes decode as ``t<id>``), so an OpenAI server can detokenize
    whatever random weights generate; it has a plain chat template for ``/v1/chat/completions``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab_size = int(config["vocab_size"])
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for i in range(len(vocab), vocab_size - 2):
        vocab[f"t{i}"] = i
    vocab["<s>"], vocab["</s>"] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    cfg = {**config, "bos_token_id": vocab_size - 2, "eos_token_id": vocab_size - 1}
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path
