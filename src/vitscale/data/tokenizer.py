"""CLIP's byte-level BPE tokenizer (OpenAI CLIP / OpenCLIP `simple_tokenizer`), 49,408 tokens.

    tokenize(["a photo of a cat."], context_length=77) -> int64 [1, 77]
    = [<start_of_text>=49406, ids..., <end_of_text>=49407, 0, 0, ...]

Text is cleaned as CLIP does (ftfy.fix_text, html.unescape twice, whitespace collapsed,
lowercased; without ftfy installed, e.g. on a bare GPU image, fix_text is skipped: plain text
tokenizes the same, mojibake, ligatures and fullwidth letters are left as they are), split with CLIP's regex and encoded with the merges of `bpe_simple_vocab_16e6.txt.gz`.
Too long captions are cut to `context_length` with the last token set to <end_of_text>
(OpenCLIP's behaviour). The vocabulary file is the one shipped in the PyPI package
open-clip-torch (found without importing it) or the file named by $VITSCALE_BPE_VOCAB.
"""

from __future__ import annotations

import functools
import gzip
import html
import importlib.util
import os
from pathlib import Path

import torch

from ..errors import DataError

VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
VOCAB_SIZE = 49408
SOT, EOT = "<start_of_text>", "<end_of_text>"
SOT_ID, EOT_ID = 49406, 49407
NUM_MERGES = 49152 - 256 - 2


def vocab_path() -> Path:
    """$VITSCALE_BPE_VOCAB, else the file inside the installed open_clip package (not imported)."""
    env = os.environ.get("VITSCALE_BPE_VOCAB")
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise DataError(f"VITSCALE_BPE_VOCAB={env}: no such file (expected {VOCAB_FILE})")
        return p
    try:
        spec = importlib.util.find_spec("open_clip")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        p = Path(folder) / VOCAB_FILE
        if p.is_file():
            return p
    raise DataError(
        f"CLIP tokenizer: {VOCAB_FILE} not found; install it with "
        f"'pip install --no-deps open-clip-torch' or set VITSCALE_BPE_VOCAB to the file"
    )


@functools.cache
def bytes_to_unicode() -> dict:
    """Byte -> printable unicode character (the reversible byte-level alphabet of GPT-2/CLIP)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _pairs(word: tuple) -> set:
    return set(zip(word[:-1], word[1:]))


def _deps():
    """(ftfy.fix_text or None, regex): regex is required, ftfy optional (it repairs mojibake and
    replaces ligatures and fullwidth letters; other captions come out the same without it)."""
    try:
        import regex
    except ImportError as e:
        raise DataError(f"CLIP tokenizer needs regex ({e}): pip install regex") from None
    try:
        from ftfy import fix_text
    except ImportError:
        fix_text = None
    return fix_text, regex


class SimpleTokenizer:
    def __init__(self, path: str | os.PathLike | None = None):
        self.fix_text, regex = _deps()
        path = Path(path) if path else vocab_path()
        try:
            lines = gzip.open(path).read().decode("utf-8").split("\n")
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise DataError(f"CLIP tokenizer: cannot read {path}: {e}") from None
        merges = [tuple(m.split()) for m in lines[1 : NUM_MERGES + 1]]
        if len(merges) != NUM_MERGES or any(len(m) != 2 for m in merges):
            raise DataError(
                f"CLIP tokenizer: {path} is not CLIP's BPE vocabulary "
                f"({len(merges)} merges, expected {NUM_MERGES})"
            )
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        vocab = list(self.byte_encoder.values())
        vocab += [v + "</w>" for v in vocab] + ["".join(m) for m in merges] + [SOT, EOT]
        self.encoder = {t: i for i, t in enumerate(vocab)}
        self.decoder = {i: t for t, i in self.encoder.items()}
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}
        self.cache = {SOT: SOT, EOT: EOT}
        self.pat = regex.compile(
            rf"{SOT}|{EOT}|'s|'t|'re|'ve|'m|'ll|'d|[\p{{L}}]+|[\p{{N}}]|"
            r"[^\s\p{L}\p{N}]+",
            regex.IGNORECASE,
        )
        self.vocab_size = len(self.encoder)
        self.sot_id, self.eot_id = self.encoder[SOT], self.encoder[EOT]
        assert (self.vocab_size, self.sot_id, self.eot_id) == (VOCAB_SIZE, SOT_ID, EOT_ID)

    def clean(self, text: str) -> str:
        text = self.fix_text(text) if self.fix_text is not None else text
        text = html.unescape(html.unescape(text)).strip()
        return " ".join(text.split()).lower()

    def bpe(self, token: str) -> str:
        """One pre-token (byte-encoded) -> its BPE pieces joined by spaces (memoized)."""
        if token in self.cache:
            return self.cache[token]
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        pairs = _pairs(word)
        if not pairs:
            return token + "</w>"
        ranks = self.bpe_ranks
        while True:
            bigram = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if bigram not in ranks:
                break
            first, second = bigram
            new, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new.extend(word[i:])
                    break
                new.extend(word[i:j])
                i = j
                if i < len(word) - 1 and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(first)
                    i += 1
            word = tuple(new)
            if len(word) == 1:
                break
            pairs = _pairs(word)
        out = " ".join(word)
        if len(self.cache) < 1_000_000:  # bounded: captions can be endless
            self.cache[token] = out
        return out

    def encode(self, text: str) -> list[int]:
        ids = []
        for tok in self.pat.findall(self.clean(text)):
            tok = "".join(self.byte_encoder[b] for b in tok.encode("utf-8"))
            ids.extend(self.encoder[piece] for piece in self.bpe(tok).split(" "))
        return ids

    def decode(self, ids) -> str:
        """Token ids -> text (padding, start and end tokens dropped; words end with a space)."""
        ids = [int(i) for i in ids if int(i) not in (0, self.sot_id, self.eot_id)]
        text = "".join(self.decoder[i] for i in ids)
        raw = bytearray(self.byte_decoder[c] for c in text)
        return raw.decode("utf-8", errors="replace").replace("</w>", " ")

    def __call__(self, texts, context_length: int = 77) -> torch.Tensor:
        """str or list[str] -> int64 [N, context_length]: sot, ids, eot, zero padding."""
        if isinstance(texts, str):
            texts = [texts]
        if context_length < 2:
            raise DataError(
                f"model.context_length must be >= 2 (start and end tokens), got {context_length}"
            )
        out = torch.zeros(len(texts), context_length, dtype=torch.long)
        for i, text in enumerate(texts):
            ids = [self.sot_id] + self.encode(text) + [self.eot_id]
            if len(ids) > context_length:
                ids = ids[:context_length]
                ids[-1] = self.eot_id
            out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


@functools.cache
def get_tokenizer() -> SimpleTokenizer:
    """The process-wide tokenizer (the vocabulary is read once)."""
    return SimpleTokenizer()


def tokenize(texts, context_length: int = 77) -> torch.Tensor:
    """str or list[str] -> int64 [N, context_length] (see the module docstring)."""
    return get_tokenizer()(texts, context_length)


def readable(name: str) -> str:
    """A class or category name as caption text: 'old_house' -> 'old house'."""
    return name.replace("_", " ").strip()
