"""Text to tokens: a byte-level BPE trained (or loaded) with Hugging Face ``tokenizers``, and the
numbers a training plan needs from a corpus.

The tokenizer is GPT-2 style (Radford et al. 2019, sec. 2.2): byte-level pre-tokenization, so every
string is representable, and BPE merges learnt on the corpus up to the model's vocabulary size
(``tokenizers.trainers.BpeTrainer``; merges stop early when the corpus has no pair seen at least
``min_frequency`` times). A ``tokenizer.json`` (for example the model's own) can be loaded instead.

Sequences follow Megatron-LM's GPT dataset (``megatron/core/datasets/gpt_dataset.py``): documents
are concatenated into one token stream and cut into samples of ``seq_length`` tokens plus one
label token shared with the next sample, so an epoch of ``T`` tokens holds
``(T - 1) // seq_length`` sequences; an iteration consumes ``global_batch_size`` of them.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import InputFormatError, WiretraceError

#: End-of-document token of the trained tokenizer (GPT-2's name for it).
EOD = "<|endoftext|>"


def train_bpe(corpus: str | Path, vocab_size: int, min_frequency: int = 2):
    """Train a byte-level BPE on the text file ``corpus``.

    Parameters
    ----------
    corpus : UTF-8 text file.
    vocab_size : target vocabulary (the model's ``vocab_size``), including the 256 byte symbols and
        the end-of-document token.
    min_frequency : a merge needs a pair seen at least this many times.

    Returns
    -------
    tokenizers.Tokenizer

    Raises
    ------
    WiretraceError : the corpus cannot be read or is empty.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = _check_corpus(corpus)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(path)], trainer)
    return tok


def load_tokenizer(path: str | Path):
    """Load a ``tokenizer.json``; raise :class:`InputFormatError` naming the file when it cannot."""
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise InputFormatError(f"--tokenizer {p}: no such file")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise InputFormatError(f"--tokenizer {p}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})") from None


def _check_corpus(corpus: str | Path) -> Path:
    p = Path(corpus)
    if p.is_dir():
        raise WiretraceError(f"--corpus {p}: is a directory, expected a text file")
    if not p.is_file():
        raise WiretraceError(f"--corpus {p}: no such file")
    if p.stat().st_size == 0:
        raise WiretraceError(f"--corpus {p}: the file is empty")
    return p


@dataclass(frozen=True)
class CorpusStats:
    """What a corpus amounts to for a plan.

    Attributes
    ----------
    corpus : path of the text.
    bytes, characters, words, lines : size of the text (words: whitespace-separated).
    tokenizer : ``"trained BPE"`` or the loaded file.
    vocab_size : vocabulary of the tokenizer actually used; ``vocab_target`` the model's.
    tokens : tokens of the whole corpus (lines encoded with their newlines).
    tokens_per_word, bytes_per_token : ratios; None when the corpus has no words (only
        whitespace) or no tokens.
    seq_length, global_batch_size : from the plan.
    sequences : ``(tokens - 1) // seq_length`` training samples per epoch.
    iterations_per_epoch : ``sequences / global_batch_size`` (fractional).
    tokens_per_iteration : ``global_batch_size * seq_length``.
    example : the first line of five words or more (else the first non-empty one) and its tokens
        (strings, byte-level: ``Ġ`` marks a leading space, ``Ċ`` a newline) and ids, to show.
    seconds : time spent training/loading and encoding.
    """

    corpus: str
    bytes: int
    characters: int
    words: int
    lines: int
    tokenizer: str
    vocab_size: int
    vocab_target: int
    tokens: int
    tokens_per_word: float | None
    bytes_per_token: float | None
    seq_length: int
    global_batch_size: int
    sequences: int
    iterations_per_epoch: float
    tokens_per_iteration: int
    example: dict
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def corpus_stats(corpus: str | Path, seq_length: int, global_batch_size: int, vocab_size: int,
                 tokenizer: str | Path | None = None, min_frequency: int = 2) -> CorpusStats:
    """Tokenize ``corpus`` and count what a plan with these dimensions makes of it.

    A BPE is trained on the corpus at ``vocab_size`` unless ``tokenizer`` (a ``tokenizer.json``)
    is given.

    Raises
    ------
    WiretraceError : unreadable or empty corpus, or unreadable tokenizer file.
    """
    t0 = time.perf_counter()
    path = _check_corpus(corpus)
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise WiretraceError(f"--corpus {path}: not UTF-8 text (byte {e.start})") from None
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
        source = str(tokenizer)
    else:
        tok = train_bpe(path, vocab_size, min_frequency)
        source = "trained BPE"
    lines = text.splitlines(keepends=True)
    encs = tok.encode_batch(lines)
    n_tokens = sum(len(e.ids) for e in encs)
    words = len(text.split())
    first = next((i for i, ln in enumerate(lines) if len(ln.split()) >= 5),
                 next((i for i, ln in enumerate(lines) if ln.strip()), 0))
    example = {"text": lines[first].rstrip("\n") if lines else "",
               "tokens": list(encs[first].tokens) if encs else [],
               "ids": list(encs[first].ids) if encs else []}
    sequences = max(n_tokens - 1, 0) // seq_length
    return CorpusStats(
        corpus=str(path), bytes=len(raw), characters=len(text), words=words, lines=len(lines),
        tokenizer=source, vocab_size=tok.get_vocab_size(), vocab_target=vocab_size, tokens=n_tokens,
        tokens_per_word=n_tokens / words if words else None,
        bytes_per_token=len(raw) / n_tokens if n_tokens else None,
        seq_length=seq_length, global_batch_size=global_batch_size, sequences=sequences,
        iterations_per_epoch=sequences / global_batch_size, tokens_per_iteration=seq_length * global_batch_size,
        example=example, seconds=time.perf_counter() - t0,
    )
