#!/usr/bin/env python3
"""Turns a Llama-architecture GGUF (the engine's SmolLM2-135M-Instruct) into a Hugging Face model
directory that vLLM loads from disk: `model.safetensors` (every tensor dequantized to float32),
`config.json` from the GGUF's metadata, and the tokenizer files the engine exported from the same
GGUF (`mstar-engine export-tokenizer --out DIR`), copied in. Nothing is fetched.

    python3 python/scripts/gguf-to-hf.py --tokenizer TOKENIZER_DIR --out MODEL_DIR [--gguf FILE]

`--gguf` defaults to the file `engine/scripts/fetch-model.py` installs
(`${XDG_CACHE_HOME:-$HOME/.cache}/mstar-chunking/SmolLM2-135M-Instruct.Q4_1.gguf`). Needs the
`gguf`, `numpy` and `safetensors` packages.

llama.cpp's converter stores the query and key projections with each head's rotary halves
interleaved; Hugging Face's Llama keeps them as two halves (`rotate_half`). The permutation is
undone here, so the model computes what the GGUF computes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class ConvertError(Exception):
    """A GGUF this script cannot turn into a Hugging Face directory, with what and where."""


def default_gguf() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mstar-chunking" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor name."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ConvertError(f"tensor {name!r}: not a weight or bias")
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.{suffix}"
    raise ConvertError(f"tensor {name!r}: no Hugging Face Llama name for it")


def unpermute(w, heads: int):
    """Undoes llama.cpp's rotary permutation of a query or key projection (rows = heads × dim)."""
    rows = w.shape[0]
    if rows % (2 * heads):
        raise ConvertError(f"{rows} rows do not split into {heads} heads of two rotary halves")
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def field(reader, key: str, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required:
            raise ConvertError(f"metadata key {key!r} is missing")
        return None
    return f.contents()


def convert(gguf_path: Path, tokenizer_dir: Path, out: Path) -> dict:
    import gguf
    import numpy as np
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise ConvertError(f"general.architecture is {arch!r}: only 'llama' is converted")
    heads = int(field(reader, "llama.attention.head_count"))
    kv_heads = int(field(reader, "llama.attention.head_count_kv", required=False) or heads)
    hidden = int(field(reader, "llama.embedding_length"))

    tensors = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest axis first
        if w.size != int(np.prod(shape)):
            raise ConvertError(f"tensor {t.name!r}: {w.size} values for shape {shape}")
        w = w.reshape(shape)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    if "model.embed_tokens.weight" not in tensors:
        raise ConvertError("tensor 'token_embd.weight' is missing")
    tied = "lm_head.weight" not in tensors
    layers = int(field(reader, "llama.block_count"))
    vocab = field(reader, "llama.vocab_size", required=False)
    vocab = int(vocab) if vocab is not None else tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(field(reader, "llama.context_length")),
        "rms_norm_eps": float(field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field(reader, "llama.rope.freq_base", required=False) or 10000.0),
        "vocab_size": vocab,
        "bos_token_id": int(field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(reader, "tokenizer.ggml.eos_token_id")),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for i in range(layers):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            if f"model.layers.{i}.{part}.weight" not in tensors:
                raise ConvertError(f"layer {i}: {part} is missing")

    missing = [f for f in TOKENIZER_FILES if not (tokenizer_dir / f).is_file()]
    if missing:
        raise ConvertError(
            f"--tokenizer {tokenizer_dir}: no {', '.join(missing)} (write them with "
            f"`mstar-engine export-tokenizer --out {tokenizer_dir}`)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / f, out / f)
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF (default: the engine's SmolLM2)")
    ap.add_argument("--tokenizer", type=Path, required=True, help="mstar-engine export-tokenizer's directory")
    ap.add_argument("--out", type=Path, required=True, help="the Hugging Face directory to write")
    a = ap.parse_args()
    path = a.gguf or default_gguf()
    if not path.is_file():
        print(f"gguf-to-hf: --gguf {path}: not a file (python3 engine/scripts/fetch-model.py installs it)", file=sys.stderr)
        return 1
    if a.out.exists() and not a.out.is_dir():
        print(f"gguf-to-hf: --out {a.out}: exists and is not a directory", file=sys.stderr)
        return 1
    try:
        convert(path, a.tokenizer, a.out)
    except ConvertError as e:
        print(f"gguf-to-hf: {path}: {e}", file=sys.stderr)
        return 1
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
