"""CLIP BPE tokenizer: fixed ids from OpenCLIP, and parity with open_clip when it imports."""

import importlib.util

import pytest
import torch

from vitscale.data import tokenizer as tk
from vitscale.errors import DataError

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("open_clip") is None,
    reason="the BPE vocabulary ships in open-clip-torch (pip install --no-deps open-clip-torch)",
)

CAPTIONS = [
    "a photo of a cat.",
    "A PHOTO OF A DOG!",
    "",
    "   ",
    "clip art of 2 dead frogs: kwaakwaa, squeleton, froggies, green",
    "Tom &amp; Jerry &lt;3 &amp;amp; friends",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 and \u4e2d\u6587",
    "emoji \U0001f600\U0001f431 party \U0001f389",
    "numbers 1234567 3.14159 1,000,000 and 42nd",
    "it's they're we've I'm you'll he'd don't",
    "punctuation!!! ??? ... --- (brackets) [square] {curly} <angle>",
    "tabs\tand\nnewlines\r\n  and   spaces",
    "mojibake: \u00c3\u00a9t\u00c3\u00a9 \u00e2\u20ac\u0153quoted\u00e2\u20ac\x9d",
    "HTML &quot;quotes&quot; &#39;apostrophes&#39; &#x263A;",
    "http://example.com/path?query=1&x=y#frag",
    "user@example.com #hashtag @mention $100 50% off",
    "\u0417\u0434\u0440\u0430\u0432\u0441\u0442\u0432\u0443\u0439 \u043c\u0438\u0440 \u2014 \u03b1\u03b2\u03b3 \u0394",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "a very long caption " + "with many repeated words and clauses, " * 20,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "<start_of_text> inside <end_of_text> text",
    "under_score snake_case camelCase PascalCase",
    "signs and symbols",
    "a drawing of transportation.",
    "\u00bd \u00bc \u2153 fractions \u00b2 \u00b3 superscripts",
    "zero\u200bwidth and non\u00a0breaking",
    "x" * 300,
    "\ufb01ne ligature \uff46\uff55\uff4c\uff4c\uff57\uff49\uff44\uff54\uff48",
    "The quick brown fox jumps over the lazy dog. 0123456789",
]

# ids produced by open_clip 3.3.0 tokenize() (OpenCLIP's own tokenizer, run in a separate venv
# with torchvision stubbed), non-zero part of the 77-token rows
EXPECTED = {
    "a photo of a cat.": [49406, 320, 1125, 539, 320, 2368, 269, 49407],
    "clip art of 2 dead frogs: kwaakwaa, squeleton, froggies, green": [
        49406,
        9289,
        794,
        539,
        273,
        2747,
        20781,
        281,
        32784,
        819,
        35874,
        267,
        9721,
        7462,
        267,
        26494,
        5505,
        267,
        1901,
        49407,
    ],
    "Tom &amp; Jerry caf\u00e9 \U0001f600 42nd": [
        49406,
        2435,
        261,
        9164,
        15304,
        7334,
        275,
        273,
        1764,
        49407,
    ],
}
# open_clip 3.3.0 tokenize(CAPTIONS[19], context_length=16): truncated, last token = eot
EXPECTED_LONG_16 = [
    49406,
    320,
    1070,
    1538,
    11327,
    593,
    1346,
    27904,
    2709,
    537,
    940,
    5282,
    267,
    593,
    1346,
    49407,
]


@pytest.mark.parametrize("text", list(EXPECTED))
def test_known_ids(text):
    t = tk.tokenize(text)
    assert t.shape == (1, 77) and t.dtype == torch.int64
    ids = EXPECTED[text]
    assert t[0, : len(ids)].tolist() == ids and not t[0, len(ids) :].any()


def test_truncation_keeps_eot_last():
    t = tk.tokenize([CAPTIONS[19], "a cat"], context_length=16)
    assert t.shape == (2, 16)
    assert t[0].tolist() == EXPECTED_LONG_16
    assert t[1].tolist()[:4] == [tk.SOT_ID, 320, 2368, tk.EOT_ID] and not t[1, 4:].any()
    t = tk.tokenize(["x" * 300, ""], context_length=2)
    assert t.tolist() == [[tk.SOT_ID, tk.EOT_ID], [tk.SOT_ID, tk.EOT_ID]]


def test_vocab_and_specials():
    tok = tk.get_tokenizer()
    assert tok.vocab_size == 49408 == tk.VOCAB_SIZE
    assert (tok.sot_id, tok.eot_id) == (49406, 49407)
    t = tk.tokenize(["", "   ", "Hello  World"])
    assert t[0, :2].tolist() == [49406, 49407] and not t[0, 2:].any()
    assert torch.equal(t[0], t[1])
    assert tok.decode(t[2]) == "hello world "
    # every row: one sot first, one eot, zeros after it
    t = tk.tokenize([c for c in CAPTIONS if "_of_text>" not in c])  # (those become specials,
    for row in t.tolist():  # as in OpenCLIP)
        end = row.index(49407)
        assert row[0] == 49406 and 49407 not in row[:end] and not any(row[end + 1 :])
        assert all(0 < i < 49406 for i in row[1:end])


def test_bad_context_and_missing_vocab(monkeypatch, tmp_path):
    with pytest.raises(DataError):
        tk.tokenize("a", context_length=1)
    monkeypatch.setenv("VITSCALE_BPE_VOCAB", str(tmp_path / "missing.txt.gz"))
    with pytest.raises(DataError, match="VITSCALE_BPE_VOCAB"):
        tk.vocab_path()


def test_parity_with_open_clip():
    try:
        import open_clip
    except Exception as e:  # noqa: BLE001 - CPU torch: torchvision's CUDA ops make it fail
        pytest.skip(
            f"open_clip does not import here ({type(e).__name__}); parity is checked "
            f"in a venv with torchvision stubbed (shared/tools/tv_cpu_stub)"
        )
    for n in (77, 16):
        assert torch.equal(tk.tokenize(CAPTIONS, n), open_clip.tokenize(CAPTIONS, context_length=n))


def test_without_ftfy_well_formed_captions_are_unchanged(monkeypatch):
    """A bare GPU image has no ftfy: the tokenizer still works there, and only captions that ftfy
    rewrites (mojibake, ligatures, fullwidth letters) tokenize differently."""
    with_ftfy = tk.SimpleTokenizer()
    monkeypatch.setitem(__import__("sys").modules, "ftfy", None)  # `from ftfy import ...` fails
    without = tk.SimpleTokenizer()
    assert with_ftfy.fix_text is not None and without.fix_text is None
    differ = [c for c in CAPTIONS if with_ftfy.encode(c) != without.encode(c)]
    assert differ == [c for c in CAPTIONS if c.startswith(("mojibake", "\ufb01ne ligature"))]
