"""Tokenization of the real corpus (Divina Commedia, read from ../shared/data) with a byte-level BPE.

Training a BPE on the 553 kB corpus takes a fraction of a second with ``tokenizers``; the tests
train at the models' own vocabulary sizes (GPT-2's 50257, where merges stop early because the
corpus runs out of pairs seen twice) and at small ones (1000, 8000) to compare.
"""

from __future__ import annotations

import re

import pytest

from wiretrace.errors import WiretraceError
from wiretrace.tokens import corpus_stats, load_tokenizer, train_bpe

from conftest import SHARED

CORPUS = SHARED / "data" / "divina_commedia.txt"


@pytest.fixture(scope="module")
def corpus():
    if not CORPUS.is_file():
        pytest.fail(f"{CORPUS} is missing: the shared corpus must sit beside the checkout")
    return CORPUS


@pytest.fixture(scope="module")
def gpt2_stats(corpus):
    return corpus_stats(corpus, seq_length=1024, global_batch_size=16, vocab_size=50257)


def test_counts_of_the_corpus(corpus, gpt2_stats):
    """Size of the text as the corpus README describes it (100 cantos, one verse per line)."""
    text = corpus.read_text(encoding="utf-8")
    st = gpt2_stats
    assert st.bytes == corpus.stat().st_size == 552_810
    assert st.lines == text.count("\n") + (0 if text.endswith("\n") else 1)
    assert st.words == len(text.split())
    assert st.example["text"] == "Nel mezzo del cammin di nostra vita"
    assert "".join(st.example["tokens"]).replace("Ġ", " ").replace("Ċ", "\n") == "Nel mezzo del cammin di nostra vita\n"


def test_bpe_is_lossless_and_counts_match_whole_text_encoding(corpus):
    """Byte-level BPE (GPT-2, Radford et al. 2019 sec. 2.2) round-trips any text exactly; encoding
    line by line gives the same token count as encoding tercet by tercet (the byte-level
    pre-tokenizer splits at newlines anyway)."""
    tok = train_bpe(corpus, 8000)
    text = corpus.read_text(encoding="utf-8")
    canto = text[:5000]
    assert tok.decode(tok.encode(canto).ids) == canto
    st = corpus_stats(corpus, 1024, 16, 8000)
    tercets = re.split(r"(?<=\n\n)", text)
    assert "".join(tercets) == text and len(tercets) > 4000
    assert st.tokens == sum(len(e.ids) for e in tok.encode_batch(tercets))
    assert st.vocab_size == 8000


def test_vocabulary_sizes_and_compression(corpus, gpt2_stats):
    """A larger vocabulary cuts the text into fewer tokens; at GPT-2's 50257 the merges stop when no
    pair occurs twice, well below the target on a 553 kB corpus."""
    small = corpus_stats(corpus, 1024, 16, 1000)
    assert small.vocab_size == 1000
    assert gpt2_stats.vocab_target == 50257 and 1000 < gpt2_stats.vocab_size < 50257
    assert small.tokens > gpt2_stats.tokens
    assert 1.0 < gpt2_stats.tokens_per_word < small.tokens_per_word
    assert gpt2_stats.bytes_per_token == pytest.approx(552_810 / gpt2_stats.tokens)


def test_sequences_and_iterations_per_epoch(gpt2_stats):
    """Megatron-LM GPT dataset: (tokens - 1) // seq_length samples per epoch (one extra label
    token), global_batch_size samples per iteration."""
    st = gpt2_stats
    assert st.sequences == (st.tokens - 1) // 1024
    assert st.iterations_per_epoch == pytest.approx(st.sequences / 16)
    assert st.tokens_per_iteration == 16 * 1024


def test_load_tokenizer_json(corpus, tmp_path):
    """A saved tokenizer.json is used as is (no training): the same counts as the trained one."""
    tok = train_bpe(corpus, 3000)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    st = corpus_stats(corpus, 2048, 8, 50257, tokenizer=path)
    assert st.tokenizer == str(path) and st.vocab_size == 3000
    lines = corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    assert st.tokens == sum(len(e.ids) for e in tok.encode_batch(lines))


def test_errors(tmp_path, corpus):
    with pytest.raises(WiretraceError, match="no such file"):
        corpus_stats(tmp_path / "none.txt", 1024, 8, 1000)
    with pytest.raises(WiretraceError, match="is a directory"):
        corpus_stats(tmp_path, 1024, 8, 1000)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(WiretraceError, match="empty"):
        corpus_stats(empty, 1024, 8, 1000)
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(WiretraceError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(bad)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("perché".encode("latin-1"))
    with pytest.raises(WiretraceError, match="not UTF-8"):
        corpus_stats(latin1, 1024, 8, 1000)


def test_a_corpus_of_whitespace_has_no_words_and_strict_json(tmp_path):
    """Whitespace only: zero words, so tokens per word has no value (None, JSON null, never a
    bare NaN that strict JSON parsers refuse); the bytes per token still count."""
    import json

    ws = tmp_path / "ws.txt"
    ws.write_text("   \n\n\t\n")
    st = corpus_stats(ws, 1024, 8, 300)
    assert st.words == 0 and st.tokens_per_word is None
    assert st.bytes == 7 and st.bytes_per_token == pytest.approx(7 / st.tokens)
    assert '"tokens_per_word": null' in json.dumps(st.to_dict(), allow_nan=False)
