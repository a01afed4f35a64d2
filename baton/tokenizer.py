"""Tokenizers and chat templates come from `transformers`; GGUF vocabularies are converted once and cached."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: Path, cache_dir: Path, tokenizer: str | None = None) -> PreTrainedTokenizerBase | None:
    """None for a model directory without tokenizer files: it then takes token-id prompts only."""
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if model_path.suffix != ".gguf":
        if not any((model_path / f).exists() for f in _TOKENIZER_FILES):
            logger.warning("%s has no tokenizer: only token-id prompts are accepted", model_path)
            return None
        return AutoTokenizer.from_pretrained(str(model_path))
    stat = model_path.stat()
    key = hashlib.sha256(f"{model_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir / "tokenizers" / key
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("converting the tokenizer of %s (cached in %s)", model_path.name, cached)
    tok = _gguf_tokenizer(model_path)
    _save_atomically(tok, cached)
    return tok


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """A GGUF file's tokenizer, as transformers converts it; for an architecture transformers does not
    load (the hybrids llama.cpp writes), from the vocabulary's own kind (tokenizer.ggml.model), which
    is all the conversion reads."""
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as e:
        if "is not supported yet" not in str(e):
            raise
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, vocabulary, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _save_atomically(tok: PreTrainedTokenizerBase, cached: Path) -> None:
    """Save into a unique temporary directory, then rename it into place: a reader never sees a
    half-written tokenizer, and when another process got there first, its copy stays and ours goes."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f".{cached.name}."))
    try:
        tok.save_pretrained(str(tmp))
        os.rename(tmp, cached)  # fails if `cached` appeared meanwhile (and is not empty)
    except OSError as e:
        if not (cached / "tokenizer_config.json").exists():  # not another process's copy: say so, serve ours
            logger.warning("could not cache the tokenizer in %s: %s", cached, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def apply_chat_template(tok: PreTrainedTokenizerBase | None, messages: list[dict], **template_kwargs) -> list[int]:
    """`template_kwargs`: variables the template reads (enable_thinking, ...), checked by the caller."""
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    return tok.encode(text, add_special_tokens=False)


def generation_eos_ids(path: Path) -> set[int]:
    """The eos ids a model directory's generation_config.json adds (HF stops on them too)."""
    gen = path / "generation_config.json" if path.is_dir() else None
    if gen is None or not gen.exists():
        return set()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
