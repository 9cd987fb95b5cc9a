"""A draft vocabulary for a draft model: the tokens its lm_head scores when it drafts (`draft_vocab.json`).

    python benchmarks/draft_vocab.py "$(python benchmarks/real_pair.py --print draft)" --size 32768

A small draft's lm_head over a 152k-token vocabulary is a third of its step; over the tokens text mostly uses it is a
fraction of that, and drafts stay guesses, so verification is as exact as before. The tokens are the `--size` most
frequent in the openly licensed prompts of data/prompts/ (never an evaluation set) and in the draft's own greedy
answers to the first `--answers` of them through its chat template (the tokens never seen: the lowest ids, which
BPE vocabularies give their commonest merges), and the tokenizer's special tokens. The file goes beside the
model, <stem>.draft_vocab.json for a GGUF and draft_vocab.json in a directory, where `draft_target` reads it;
delete it to draft over the whole vocabulary again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.models.chat_template import chat_texts
from specserve.engine.engine import Engine
from specserve.models.loader import load_model
from specserve.speculative.sampling import SamplingParams
from specserve.speculative.weights import draft_vocab_file, write_draft_vocab
from specserve.train.vocab import most_frequent

PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts"


def prompt_texts() -> list[str]:
    return [json.loads(line)["text"] for path in sorted(PROMPTS.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="the draft model (a GGUF file or a checkpoint directory)")
    parser.add_argument("--size", type=int, default=32768)
    parser.add_argument("--answers", type=int, default=64, help="prompts the draft answers (0: prompts only)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    draft = load_model(str(args.model))
    tokenizer, vocab_size = draft.tokenizer, draft.model.spec.vocab_size
    texts = prompt_texts()
    ids = [torch.tensor(tokenizer(text)["input_ids"]) for text in texts]
    engine = Engine(draft)
    params = SamplingParams(max_tokens=args.max_tokens)
    for text in tqdm(chat_texts(tokenizer, texts[:args.answers]), desc="answers"):
        ids.append(torch.tensor(engine.generate(text, params).token_ids))
    counted = torch.cat(ids)
    vocab = most_frequent(counted, vocab_size, args.size)
    special = torch.tensor([i for i in tokenizer.all_special_ids if i < vocab_size], dtype=torch.long)
    vocab = torch.unique(torch.cat([vocab, special]))
    write_draft_vocab(args.model, vocab)
    distinct = torch.unique(counted[counted < vocab_size]).numel()
    print(f"{draft_vocab_file(args.model)}: {vocab.numel()} tokens of {vocab_size} (of the {counted.numel()} "
          f"counted, {distinct} distinct: the {min(distinct, args.size)} commonest, then the lowest ids, and the "
          f"special tokens)")


if __name__ == "__main__":
    main()
