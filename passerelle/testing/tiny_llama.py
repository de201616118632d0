"""Write a tiny random-weight Llama as a Hugging Face directory that vLLM can serve.

Run with the vLLM venv's Python (it needs torch, transformers and tokenizers; it imports nothing
from passerelle)::

    ~/.cache/passerelle/vllm-venv/bin/python passerelle/testing/tiny_llama.py --out DIR --corpus passerelle/

The tokenizer is a byte-level BPE of 2,000 tokens trained on the ``.py`` and ``.md`` files under
``--corpus``; the weights are random (seed 0): 2 layers, hidden 128, 2 heads of 64. It generates
noise, quickly: good for exercising a runtime, not for reading. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the vLLM venv has transformers
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>' }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)


def corpus_files(root: Path) -> list[str]:
    files = sorted(p for p in root.rglob("*") if p.suffix in (".py", ".md") and p.is_file())
    if not files:
        raise SystemExit(f"no .py or .md files under {root} to train the tokenizer on")
    return [str(p) for p in files]


def train_tokenizer(files: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD, *ROLE_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train(files, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=8192)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast, *, hidden: int, layers: int, heads: int,
                seed: int) -> LlamaForCausalLM:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpus", type=Path, required=True, help="folder of .py/.md files for the tokenizer")
    parser.add_argument("--model-id", default="tiny-llama")
    parser.add_argument("--vocab-size", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    files = corpus_files(args.corpus)
    tokenizer = train_tokenizer(files, args.vocab_size)
    model = build_model(tokenizer, hidden=args.hidden, layers=args.layers, heads=args.heads, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"tiny Llama {args.model_id}: {params:,} parameters, {len(tokenizer)} tokens "
          f"(trained on {len(files)} files) -> {args.out}")


if __name__ == "__main__":
    main()
