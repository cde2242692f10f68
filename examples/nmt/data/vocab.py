"""The translation vocabulary: a byte-level BPE trained on the training split, cached, identical on every process."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from torch import Tensor

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3, then the language tokens


def language_token(language: str) -> str:
    """The token that asks for a translation into ``language``, prepended to the source: ``<2de>``."""
    return f"<2{language}>"


class Vocabulary:
    """Byte-level BPE (no unknown words: any text round-trips) with ``<pad>=0 <s>=1 </s>=2 <unk>=3 <2xx>...``.

    Training is deterministic (the same texts give the same ids in every process, whatever its hash seed), so
    processes that miss the cache file and train it themselves still agree with those that load it.
    """

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, tokenizer: object) -> None:
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"Vocabulary wraps a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        ids = [tokenizer.token_to_id(token) for token in SPECIALS]
        if ids != [self.pad_id, self.bos_id, self.eos_id, self.unk_id]:
            raise ValueError(f"the tokenizer's special tokens {SPECIALS} must have ids 0..3, they have {ids}")
        self.tokenizer = tokenizer
        self._skip = {
            token_id
            for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items()
            if token in (PAD, BOS, EOS) or token.startswith("<2")
        }

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def lang_id(self, language: str) -> int:
        token_id = self.tokenizer.token_to_id(language_token(language))
        if token_id is None:
            raise KeyError(f"no token {language_token(language)} in the vocabulary: it was trained for other languages")
        return token_id

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, without bos, eos or a language token."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text of ``ids`` up to the first eos, skipping pad, bos and language tokens."""
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode([i for i in ids if i not in self._skip], skip_special_tokens=False).strip()

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, languages: Iterable[str]) -> Vocabulary:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE(unk_token=UNK))
        # The prefix space makes a sentence's first word the same token as that word inside a sentence.
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
        tokenizer.decoder = decoders.ByteLevel()
        specials = [*SPECIALS, *(language_token(lang) for lang in sorted(set(languages)))]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tokenizer.train_from_iterator(texts, trainer)
        return cls(tokenizer)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Vocabulary:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes atomically: processes that train at once each replace the file whole, with the same content."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        try:
            self.tokenizer.save(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    @classmethod
    def cached(
        cls, path: str | os.PathLike[str], texts: Callable[[], Iterable[str]], vocab_size: int, languages: Iterable[str]
    ) -> Vocabulary:
        """Loads ``path``, or trains on ``texts()`` and saves it there first."""
        if Path(path).is_file():
            return cls.load(path)
        vocab = cls.train(texts(), vocab_size, languages)
        vocab.save(path)
        return vocab
