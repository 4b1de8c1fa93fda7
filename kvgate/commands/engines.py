"""`kvgate engines`: real engines on this machine, for trying kvgate, its tests and its benchmarks.

  kvgate engines install vllm      create the engines' virtualenv with vLLM's CPU build and NIXL
  kvgate engines model             build (once) and print the tiny model real engines serve
  kvgate engines run vllm -n 2     start engines on loopback and print the kvgate config for them

Engines live in their own virtualenv under KVGATE_ENGINES_HOME (default ~/.cache/kvgate/engines).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
from pathlib import Path

import yaml

from kvgate.config.engines import engines_home
from kvgate.engines.install import EnginesMissing, EngineVenv, install_vllm, vllm_venv
from kvgate.engines.model import TINY_MODEL_NAME, tiny_model


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("engines", help="install, build a model for and run real engines",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True, metavar="JOB")
    install = jobs.add_parser("install", help="create the engines' virtualenv (about 100 s, 3.5 GB)")
    install.add_argument("engine", choices=["vllm"])
    install.set_defaults(func=_install)
    model = jobs.add_parser("model", help="build the tiny model once and print its directory")
    model.set_defaults(func=_model)
    run = jobs.add_parser("run", help="start engines on loopback until interrupted")
    run.add_argument("engine", choices=["vllm"])
    run.add_argument("-n", "--count", type=int, default=1, help="engines (one core each, cycling)")
    run.add_argument("--pd", action="store_true", help="one prefill and one decode engine (NIXL)")
    run.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV cache per engine")
    run.add_argument("--max-model-len", type=int, default=4096)
    run.set_defaults(func=_run)


def _install(args: argparse.Namespace) -> int:
    try:
        install_vllm(vllm_venv(engines_home()))
    except EnginesMissing as exc:
        print(f"kvgate engines install: {exc}", file=sys.stderr)
        return 1
    return 0


def find_tiny_model(command: str) -> tuple[EngineVenv, Path] | None:
    """The engines' virtualenv and the tiny model they serve (built on first use), or None after
    printing `<command>: <why not>` on stderr."""
    home = engines_home()
    venv = vllm_venv(home)
    try:
        return venv, tiny_model(venv, home)
    except EnginesMissing as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return None


def _model(args: argparse.Namespace) -> int:
    found = find_tiny_model("kvgate engines model")
    if found is None:
        return 1
    print(found[1])
    return 0


def _run(args: argparse.Namespace) -> int:
    from kvgate.engines.vllm import VLLMEngineSpec, vllm_fleet

    found = find_tiny_model("kvgate engines run")
    if found is None:
        return 1
    venv, model_dir = found
    roles = ["prefill", "decode"] if args.pd else ["neutral"] * args.count
    specs = [
        VLLMEngineSpec(model_dir, TINY_MODEL_NAME, core=i % 2, role=role, kv_cache_gib=args.kv_cache_gib,
                       max_model_len=args.max_model_len)
        for i, role in enumerate(roles)
    ]
    print(f"starting {len(specs)} vLLM engine(s), about a minute ...", file=sys.stderr)
    with vllm_fleet(specs, venv) as engines:
        config = {
            "tokenizer": str(model_dir),
            "kvs_chunk_size": specs[0].block_size,
            "hash_seed": specs[0].hash_seed,
            "instances": [
                {"id": f"vllm{i}", "url": e.url, "model": TINY_MODEL_NAME, "role": e.spec.role,
                 "max_model_len": e.spec.max_model_len}
                for i, e in enumerate(engines)
            ],
        }
        if args.pd:
            config["pd_protocol"] = "vllm"
        print(yaml.safe_dump(config, sort_keys=False), flush=True)
        print("engines ready; Ctrl-C stops them", file=sys.stderr)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0
