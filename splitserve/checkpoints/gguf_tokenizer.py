"""Rebuild a GGUF file's tokenizer as `tokenizers` JSON from its metadata.

`gpt2` vocabularies become byte-level BPE with the file's merges and the
pre-tokenizer that `tokenizer.ggml.pre` names; `llama` (SentencePiece) ones
become a SentencePiece-style BPE. Special tokens, BOS/EOS handling and the chat
template come from the same metadata (see `build_tokenizer`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from splitserve.errors import ModelLoadError, UnsupportedModelError



class GGUFMetadata(Protocol):
    """What the tokenizer reads of a GGUF file's key-value metadata (gguf_loader.py's reader)."""

    path: Path

    def get(self, key: str, default: Any = None) -> Any: ...

    def require(self, key: str) -> Any: ...

    def strings(self, key: str) -> list[str] | None: ...


# Split regexes of the pre-tokenizers llama.cpp names in `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# pre name -> (split regex or None for GPT-2's own, digits one by one, NFC, ignore_merges)
_BYTE_LEVEL_PRE = {
    "default": (None, False, False, False), "gpt-2": (None, False, False, False),
    "gpt2": (None, False, False, False),
    "smollm": (None, True, False, False), "starcoder": (None, True, False, False),
    "refact": (None, True, False, False),
    "qwen2": (_QWEN2_SPLIT, False, True, False), "deepseek-r1-qwen": (_QWEN2_SPLIT, False, True, False),
    "llama-bpe": (_LLAMA3_SPLIT, False, False, True), "llama3": (_LLAMA3_SPLIT, False, False, True),
    "llama-v3": (_LLAMA3_SPLIT, False, False, True), "smaug-bpe": (_LLAMA3_SPLIT, False, False, True),
    "tekken": (_TEKKEN_SPLIT, False, False, True),
}
_SPECIAL_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


def build_tokenizer(meta: GGUFMetadata) -> tuple[str, dict, dict]:
    """(tokenizer.json text, tokenizer_config, generation_config) from GGUF metadata.

    `gpt2` vocabularies become byte-level BPE with the file's merges and the
    pre-tokenizer `tokenizer.ggml.pre` names; `llama` (SentencePiece) ones become
    BPE with byte fallback, merges recovered from the piece scores, and the
    `▁` prefix done by normalizers — the arrangement that matches sentencepiece
    itself token for token. Control and unknown tokens become special added
    tokens; user-defined ones added (matched whole) but not special.
    """
    kind = meta.require("tokenizer.ggml.model")
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"GGUF file {meta.path} has no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta, tokens)
        add_bos_default = False
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta, tokens, types)
        add_bos_default = True
    else:
        raise UnsupportedModelError(f"{meta.path}: GGUF tokenizer model {kind!r} is not supported; "
                                    "supported: gpt2 (byte-level BPE), llama (SentencePiece)")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, ty in zip(tokens, types) if ty in (TokenType.CONTROL, TokenType.UNKNOWN)])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED])

    ids = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL_IDS.items()}
    ids = {name: int(i) for name, i in ids.items() if i is not None and 0 <= int(i) < len(tokens)}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and "bos" in ids
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos" in ids
    tokenizer.post_processor = _post_processor(kind, tokens, ids, add_bos, add_eos)

    tokenizer_config = {f"{name}_token": tokens[i] for name, i in ids.items()}
    tokenizer_config.update(add_bos_token=add_bos, add_eos_token=add_eos, clean_up_tokenization_spaces=False,
                            tokenizer_class="PreTrainedTokenizerFast")
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    generation_config = {f"{name}_token_id": i for name, i in ids.items() if name != "unk"}
    stop_ids = [ids["eos"]] if "eos" in ids else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = meta.get(key)
        if extra is not None and int(extra) not in stop_ids and 0 <= int(extra) < len(tokens):
            stop_ids.append(int(extra))
    if stop_ids:
        generation_config["eos_token_id"] = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    return tokenizer.to_str(), tokenizer_config, generation_config


def _byte_level_bpe(meta: GGUFMetadata, tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _BYTE_LEVEL_PRE:
        raise UnsupportedModelError(f"{meta.path}: GGUF pre-tokenizer {pre!r} is not supported; "
                                    f"supported: {', '.join(sorted(_BYTE_LEVEL_PRE))}")
    split, digits, nfc, ignore_merges = _BYTE_LEVEL_PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in meta.strings("tokenizer.ggml.merges") or []]
    vocab = {token: i for i, token in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: GGUFMetadata, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"GGUF file {meta.path}: a SentencePiece vocabulary needs tokenizer.ggml.scores")
    vocab = {token: i for i, token in reversed(list(enumerate(tokens)))}
    normal = [ty == TokenType.NORMAL for ty in types]
    # sentencepiece merges the adjacent pair whose union scores highest; BPE ranks do the same.
    ranked = []
    for token, score, is_normal in zip(tokens, scores, normal):
        if not is_normal:
            continue
        for cut in range(1, len(token)):
            left, right = vocab.get(token[:cut]), vocab.get(token[cut:])
            if left is not None and right is not None and normal[left] and normal[right]:
                ranked.append((-score, left, right))
    ranked.sort()
    merges = [(tokens[left], tokens[right]) for _, left, right in ranked]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True,
                                     byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _post_processor(kind: str, tokens: list[str], ids: dict[str, int], add_bos: bool, add_eos: bool):
    byte_level = processors.ByteLevel(trim_offsets=False) if kind == "gpt2" else None
    if not (add_bos or add_eos):
        return byte_level

    def around(piece: str, type_id: int) -> list[str]:
        bos = [f"{tokens[ids['bos']]}:{type_id}"] if add_bos else []
        eos = [f"{tokens[ids['eos']]}:{type_id}"] if add_eos else []
        return [*bos, f"{piece}:{type_id}", *eos]

    specials = {tokens[ids[name]]: ids[name] for name, on in (("bos", add_bos), ("eos", add_eos)) if on}
    template = processors.TemplateProcessing(single=around("$A", 0), pair=around("$A", 0) + around("$B", 1),
                                             special_tokens=list(specials.items()))
    return processors.Sequence([byte_level, template]) if byte_level else template
