"""Tokenizers and chat templates come from `transformers`; GGUF vocabularies are converted once and cached."""

from __future__ import annotations

import hashlib
import logging
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
    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    tok.save_pretrained(str(cached))
    return tok


def apply_chat_template(tok: PreTrainedTokenizerBase | None, messages: list[dict]) -> list[int]:
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("this model has no chat template; send a plain prompt instead")
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)
