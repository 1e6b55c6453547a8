"""Where a run's model and tokenizer come from, and the pins that make every peer load the same ones.

``--model`` is a preset (``peer/presets.py``), a Hugging Face model directory, or a hub name (``org/name``,
downloaded to the hub's cache when the hub can be reached). A Hugging Face model is pinned in the manifest by
content: its config itself (a few hundred bytes, so a joiner and ``peer export`` build the architecture from the
manifest alone) and that config's hash, the hub commit, the weights' hash when the run starts from them
(``--init-from-pretrained``), and the tokenizer's hash. Weights and tokenizer files never travel through the
manifest: a joiner loads its own copies, and ``localized`` checks them against the pins, one line per mismatch.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import json
import os
from typing import Any, Dict, Optional, Tuple

from dht.errors import UserError, first_line
from peer.presets import PRESETS
from peer.train.tokenizer import BUILTIN, load_tokenizer, tokenizer_hash

# config.json keys that differ between copies of one model without changing it
VOLATILE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "_commit_hash")
HUB_FILES = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken")  # what a hub download fetches


def is_preset(spec: str) -> bool:
    return spec in PRESETS


def content_hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def require_model_spec(spec: str, flag: str = "--model") -> None:
    """A one-line error unless ``spec`` is a preset, a directory, or has a hub name's shape (org/name)."""
    if is_preset(spec) or os.path.isdir(spec):
        return
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise UserError(f"{flag} {spec}: not a preset ({', '.join(PRESETS)}), nor a directory, nor a hub name "
                        f"(org/name)")


def local_copy(spec: str, revision: Optional[str], flag: str = "--model") -> str:
    """The directory of a Hugging Face model: ``spec`` itself, or the hub's snapshot of ``spec`` at ``revision``."""
    if os.path.isdir(spec):
        return spec
    require_model_spec(spec, flag)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(spec, revision=revision, allow_patterns=list(HUB_FILES))
    except Exception as e:  # the hub raises many types for a missing name, revision or network
        raise UserError(f"{flag} {spec}: not a local directory, and the hub could not give it ({first_line(e, 120)}); "
                        f"download it where the hub can be reached (hf download {spec} --local-dir DIR) "
                        f"and pass {flag} DIR") from None


def config_dict(directory: str) -> Dict[str, Any]:
    """A model directory's config.json, less the keys that do not change the model; a causal LM's, or an error."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = os.path.join(directory, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--model {directory}: no readable config.json there ({first_line(e, 120)}); pass a "
                        f"directory written by save_pretrained") from None
    if raw.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"--model {directory}: model_type {raw.get('model_type')!r} is not a causal LM that "
                        f"transformers' AutoModelForCausalLM builds (Llama, Qwen2, GPT-2, Mistral, Pythia, ...)")
    return {k: v for k, v in raw.items() if k not in VOLATILE}


def positions(config: Dict[str, Any]) -> Optional[int]:
    """The longest context a model's config allows (GPT-2 calls it ``n_positions``)."""
    return config.get("max_position_embeddings") or config.get("n_positions")


def weights_hash(directory: str) -> str:
    """SHA-256 over the weight files' bytes (safetensors, else PyTorch .bin), in name order."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors"))) or \
        sorted(glob.glob(os.path.join(directory, "*.bin")))
    if not files:
        raise UserError(f"--init-from-pretrained: {directory} holds no weights (*.safetensors or *.bin)")
    return _files_hash(tuple((f, os.path.getsize(f), os.path.getmtime(f)) for f in files))


@functools.lru_cache(maxsize=8)
def _files_hash(stats) -> str:  # keyed by (path, size, mtime): a peer hashes its copy once per process
    digest = hashlib.sha256()
    for path, _size, _mtime in stats:
        digest.update(os.path.basename(path).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def commit_of(directory: str) -> Optional[str]:
    """The hub commit of a snapshot directory (``.../snapshots/<commit>``); None for a plain directory."""
    parent, name = os.path.split(os.path.normpath(directory))
    return name if os.path.basename(parent) == "snapshots" and len(name) == 40 else None


def tokenizer_copy(run, flags: Dict[str, Any]) -> str:
    """Where this node loads the run's tokenizer from: ``--tokenizer`` as given here; else a Hugging Face model's
    own tokenizer from this node's copy of the model; else the tokenizer the run names."""
    if "tokenizer" in flags:
        return flags["tokenizer"]
    if run.tokenizer == run.model:
        return local_copy(flags.get("model", run.model), run.revision)
    return run.tokenizer


def pinned(run):
    """``run`` (resolved) with the pins of its Hugging Face model and tokenizer: what the creator signs. A Hugging
    Face model's default context is no longer than its positions."""
    default_context, run = run.seq_len is None, run.resolved()
    pins: Dict[str, Any] = {}
    if not is_preset(run.model):
        directory = local_copy(run.model, run.revision)
        config = config_dict(directory)
        pins.update(model_config=config, model_hash=content_hash(config),
                    revision=commit_of(directory) or run.revision)
        if default_context and positions(config):
            pins["seq_len"] = min(run.seq_len, positions(config))
        if run.init_from_pretrained:
            pins["weights_hash"] = weights_hash(directory)
    elif run.init_from_pretrained:
        raise UserError(f"--init-from-pretrained needs a Hugging Face --model; {run.model} is a preset")
    if run.tokenizer not in BUILTIN:
        pins["tokenizer_hash"] = tokenizer_hash(load_tokenizer(tokenizer_copy(run, {})))
    return dataclasses.replace(run, **pins)


def localized(run, flags: Dict[str, Any]):
    """The run as this node loads it: the model and tokenizer from this node's copies (``--model`` and
    ``--tokenizer`` as given here, else where the manifest names them), each checked against the run's pins."""
    if is_preset(run.model) and run.tokenizer in BUILTIN:
        return run
    model = flags.get("model", run.model)
    changes: Dict[str, Any] = {}
    if not is_preset(run.model) and (run.init_from_pretrained or "model" in flags):
        directory = _copy_of_run_model(run, model)
        theirs = config_dict(directory)
        if content_hash(theirs) != run.model_hash:
            raise UserError(f"--model {model} differs from the run's model ({difference(theirs, run.model_config)}); "
                            f"get a copy of the run's model, {_origin(run)}")
        if run.init_from_pretrained and weights_hash(directory) != run.weights_hash:
            raise UserError(f"--model {model}: its weights differ from the ones the run starts from (weights "
                            f"{weights_hash(directory)} here, {run.weights_hash} in the run); get {_origin(run)}")
        changes["model"] = directory
    if run.tokenizer not in BUILTIN:
        try:
            copy = tokenizer_copy(run, flags)
        except UserError:
            raise UserError(f"the run's tokenizer is {run.tokenizer} (hash {run.tokenizer_hash}), which this machine "
                            f"lacks; pass --tokenizer DIR with a copy of it (or --model DIR, when it is the model's "
                            f"own)") from None
        ours = tokenizer_hash(load_tokenizer(copy))
        if ours != run.tokenizer_hash:
            raise UserError(f"--tokenizer {copy} differs from the run's tokenizer (hash {ours} here, "
                            f"{run.tokenizer_hash} in the run); pass --tokenizer DIR with a copy of {run.tokenizer}")
        changes["tokenizer"] = copy
    return dataclasses.replace(run, **changes)


def copies_of(settings: Dict[str, Any], flags: Dict[str, Any]) -> Tuple[str, ...]:
    """The flags among ``flags`` that name this node's copies of the run's Hugging Face model or tokenizer (checked
    against the pins, not compared as text): another directory may hold the same model."""
    copies = []
    if "model" in flags and not is_preset(flags["model"]) and not is_preset(str(settings.get("model"))):
        copies.append("model")
    if "tokenizer" in flags and flags["tokenizer"] not in BUILTIN and settings.get("tokenizer") not in BUILTIN:
        copies.append("tokenizer")
    return tuple(copies)


def keep_tokenizer(run, checkpoint_dir: str) -> None:
    """Save a Hugging Face tokenizer beside a peer's checkpoint, once: ``peer export`` of it needs no other copy."""
    kept = os.path.join(checkpoint_dir, "tokenizer")
    if run.tokenizer not in BUILTIN and not os.path.isdir(kept):
        load_tokenizer(run.tokenizer).as_transformers().save_pretrained(kept)


def _copy_of_run_model(run, model: str) -> str:
    try:
        return local_copy(model, run.revision)
    except UserError:
        if model != run.model:
            raise
        raise UserError(f"the run starts from the weights of {_origin(run)}, which this machine lacks; "
                        f"pass --model DIR with a copy of it") from None


def _origin(run) -> str:
    at = f" at revision {run.revision}" if run.revision else ""
    return f"{run.model}{at} (config {run.model_hash}" + (f", weights {run.weights_hash})" if run.weights_hash
                                                           else ")")


def difference(ours: Dict[str, Any], theirs: Dict[str, Any], limit: int = 3) -> str:
    """The config keys two models disagree on: ``hidden_size 64 here, 128 in the run; ...``."""
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    shown = [f"{k} {ours.get(k)} here, {theirs.get(k)} in the run" for k in keys[:limit]]
    more = f"; and {len(keys) - limit} more" if len(keys) > limit else ""
    return "; ".join(shown) + more or "same keys, different hash"
