"""``python -m peer generate``: a continuation of a prompt, from an exported model or straight from a checkpoint.

    python -m peer generate --model my-model --prompt "ROMEO:"
    python -m peer generate --checkpoint-dir ckpt --prompt "ROMEO:" --max-new-tokens 200
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Optional, Sequence

from dht.cli import Parser
from dht.errors import UserError, first_line
from peer.ops.report import fail


def parse_args(argv: Optional[Sequence[str]]):
    parser = Parser(prog="python -m peer generate", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a Hugging Face model directory (python -m peer export writes one)")
    source.add_argument("--checkpoint-dir", help="a peer's checkpoint directory: its epoch's global parameters")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add (default: 100)")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature, 0 = greedy (default: 0.8)")
    parser.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest tokens (default: 50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: 0)")
    args = parser.parse_args(argv)
    if args.max_new_tokens <= 0 or args.temperature < 0 or args.top_k <= 0:
        parser.error("--max-new-tokens and --top-k take positive numbers, --temperature one >= 0")
    return args


def load(directory: str):
    """The model and tokenizer of a Hugging Face model directory, or a one-line error."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(directory):
        raise UserError(f"--model {directory}: no such directory; pass one that python -m peer export wrote")
    try:
        return AutoModelForCausalLM.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise UserError(f"--model {directory}: not a Hugging Face causal LM with its tokenizer "
                        f"({first_line(e, 120)})") from None


def continuation(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float, top_k: int,
                 seed: int) -> str:
    import torch

    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    if encoded["input_ids"].shape[1] == 0:
        raise UserError("--prompt is empty; pass some text to continue")
    torch.manual_seed(seed)
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        output = model.generate(**encoded, max_new_tokens=max_new_tokens,
                                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id or 0, **sampling)
    return tokenizer.decode(output[0, encoded["input_ids"].shape[1]:], skip_special_tokens=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
        from peer.train.model import quiet_transformers

        quiet_transformers()
        with contextlib.ExitStack() as stack:
            directory = args.model
            if directory is None:  # export the checkpoint's epoch to a scratch directory first
                from peer.use import export

                directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="diloco-generate-"))
                export.write(export.from_checkpoint(args.checkpoint_dir, {}), directory, evaluate=False)
            model, tokenizer = load(directory)
            text = continuation(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                                args.seed)
    except (UserError, ValueError) as e:
        return fail(str(e))
    print(args.prompt + text, flush=True)
    return 0
