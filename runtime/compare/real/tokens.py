"""Token strings and queries: the vocabulary from the model's tokenizer.json (or a GGUF file's own), and a query
made into one token id by the model's tokenizer (the optional tokenizers library)."""
import json
import os

from embed import UsageError
from runtime.model.read import sidecars
from runtime.model.read.text import InspectError, printable

TOKENIZER = "tokenizer.json"
TOKENIZER_MOST = 64 * 2**20  # a tokenizer.json past this is not one (Gemma's is 34 MB)


class Vocabulary:
    """`strings[id]` the token as the vocabulary holds it (`ĠParis`), None where none is named; encode(text) the
    ids the model's tokenizer makes of `text`, or None without a tokenizer."""

    def __init__(self, strings, tokenizer=None, where=None):
        self.strings, self._tokenizer, self.where = strings, tokenizer, where

    def token(self, token_id):
        """The token string of `token_id` (printable: a control character is escaped), or None."""
        if self.strings is None or token_id >= len(self.strings) or self.strings[token_id] is None:
            return None
        return printable(self.strings[token_id])

    def shown(self, token_id):
        """What a report shows for `token_id`: its string, or `#id` without one."""
        token = self.token(token_id)
        return f"#{token_id}" if token is None else token

    def encode(self, text):
        return None if self._tokenizer is None else self._tokenizer.encode(text, add_special_tokens=False).ids


def _tokenizers():
    try:
        import tokenizers
        return tokenizers
    except ImportError:
        return None


def _tokenizer_json(folder):
    """The path of tokenizer.json in `folder` or its parent (a transformers.js model's onnx/ lies below it)."""
    for where in (folder, os.path.dirname(folder)):
        path = os.path.join(where, TOKENIZER)
        if os.path.isfile(path):
            return path
    return None


def _strings_of(data, vocab_size):
    """[token string or None] * vocab_size from a parsed tokenizer.json: the model's vocab and the added tokens."""
    strings = [None] * vocab_size
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pairs = vocab.items() if isinstance(vocab, dict) else (
        ((v[0], i) for i, v in enumerate(vocab) if isinstance(v, list) and v) if isinstance(vocab, list) else ())
    added = data.get("added_tokens") if isinstance(data, dict) else None
    pairs = list(pairs) + [(a.get("content"), a.get("id")) for a in (added if isinstance(added, list) else [])
                           if isinstance(a, dict)]
    for token, token_id in pairs:
        if isinstance(token, str) and isinstance(token_id, int) and 0 <= token_id < vocab_size:
            strings[token_id] = token
    return strings


def vocabulary_of(table):
    """The Vocabulary of a source.Table: a GGUF file's own tokens (a byte-level BPE tokenizer rebuilt from them and
    its merges where tokenizers is installed), else the tokenizer.json beside the model (or above it)."""
    if table.tokens is not None:
        return Vocabulary(table.tokens, _gguf_tokenizer(table), table.model)
    path = _tokenizer_json(table.folder)
    if path is None:
        return Vocabulary(None)
    raw = sidecars.read(path, TOKENIZER, TOKENIZER_MOST)  # a regular file inside the folder, size-capped
    if raw is None:
        raise InspectError(f"{path}: not a regular file inside the model's folder, or over "
                           f"{TOKENIZER_MOST // 2**20} MiB")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise InspectError(f"{path}: not JSON ({e})") from None
    library, tokenizer = _tokenizers(), None
    if library is not None:
        try:
            tokenizer = library.Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library's own parse error, whatever its type
            raise InspectError(f"{path}: tokenizers cannot read it ({str(e).splitlines()[0][:200]})") from None
    return Vocabulary(_strings_of(data, table.vocab), tokenizer, path)


def _gguf_tokenizer(table):
    """A tokenizers BPE of a GGUF 'gpt2' (byte-level BPE) vocabulary and merges, or None."""
    library = _tokenizers()
    if library is None or table.tokenizer_model != "gpt2" or not table.merges:
        return None
    vocab = {token: i for i, token in enumerate(table.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in table.merges if " " in m]
    tokenizer = library.Tokenizer(library.models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = library.pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def resolve(queries, vocabulary, vocab_size):
    """Each query as one token id: digits are an id in [0, vocab_size); a text must make exactly one token.
    UsageError (one line) otherwise."""
    ids = []
    for query in queries:
        if query.isdigit():
            token_id = int(query)
            if token_id >= vocab_size:
                raise UsageError(f"--query {query}: id out of range [0, {vocab_size})")
            ids.append(token_id)
            continue
        made = vocabulary.encode(query)
        if made is None:
            raise UsageError(f"--query {query!r}: a text query needs the model's tokenizer ({TOKENIZER} beside the "
                             "model, and the tokenizers library); give a token id instead")
        if len(made) != 1:
            shown = ", ".join(vocabulary.shown(i) for i in made) or "none"
            raise UsageError(f"--query {query!r}: the tokenizer makes {len(made)} tokens of it ({shown}); "
                             "give a text of one token, or an id")
        if not 0 <= made[0] < vocab_size:
            raise UsageError(f"--query {query!r}: the tokenizer gives id {made[0]}, outside the table's "
                             f"[0, {vocab_size})")
        ids.append(made[0])
    return list(dict.fromkeys(ids))
