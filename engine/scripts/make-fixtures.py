#!/usr/bin/env python3
"""Writes engine/tests/fixtures/smollm2_llama_cpp.json: token ids of 20 strings and greedy
continuations of 5 prompts for SmolLM2-135M-Instruct, computed by llama.cpp (through the
`llama-cpp-python` package, which builds it from source) on the same GGUF file the engine
serves. Made once, outside CI; `engine/tests/real_model.rs` compares the engine against it.
llama.cpp keeps its KV cache in f32 here, as the engine does (its default, f16, rounds every
key and value and moves near-ties elsewhere).

    python3 -m venv /tmp/llvenv && /tmp/llvenv/bin/pip install llama-cpp-python
    make model
    /tmp/llvenv/bin/python engine/scripts/make-fixtures.py
"""

import json
import os
import subprocess
import sys

import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "smollm2_llama_cpp.json")

STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing  ",
    "tabs\tand\nnewlines\n\n",
    "Café crème brûlée, naïve façade",
    "Ångström, Øresund, Łódź, İstanbul",
    "日本語のテキストです。",
    "中文分词测试：你好世界",
    "한국어 문장입니다",
    "Emoji: 😀🚀👍🏽 and 🇫🇷",
    "Numbers 1234567890 and 3.14159, 1,000,000",
    "2024-12-01T23:59:59Z",
    "def f(x):\n    return x ** 2  # square",
    "fn main() { println!(\"{}\", 1 + 2); }",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end",
    "don't can't won't I'm you're they've",
    "HTTP/1.1 200 OK\r\nContent-Type: application/json",
    "Ελληνικά και русский текст",
    "   ",
]

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
]
GREEDY_TOKENS = 16


def main():
    gguf = subprocess.run(
        [sys.executable, os.path.join(HERE, "fetch-model.py"), "--check"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=1, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    tokenize = [
        {"text": s, "ids": llm.tokenize(s.encode(), add_bos=False, special=True)}
        for s in STRINGS
    ]
    greedy = []
    for p in PROMPTS:
        ids = llm.tokenize(p.encode(), add_bos=False, special=True)
        llm.reset()
        out = []
        for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(t)
            if len(out) == GREEDY_TOKENS:
                break
        greedy.append({"prompt": p, "prompt_ids": ids, "tokens": out,
                       "text": llm.detokenize(out).decode("utf-8", "replace")})
    doc = {
        "made_by": "engine/scripts/make-fixtures.py with llama-cpp-python "
                   f"{llama_cpp.__version__} (llama.cpp built from source, one thread, f32 KV cache)",
        "gguf": os.path.basename(gguf),
        "tokenize": tokenize,
        "greedy": greedy,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(doc, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(OUT)


if __name__ == "__main__":
    main()
