"""Token strings and queries: the vocabulary from the model's tokenizer.json (or a GGUF file's own), and a query
made into one token id by the model's tokenizer (the optional tokenizers library)."""
import json
import os
import re

from embed import UsageError
from runtime.model.read import sidecars
from runtime.model.read.layout import sidecar_folders
from runtime.model.read.text import InspectError, field

TOKENIZER = "tokenizer.json"
TOKENIZER_MOST = sidecars.TOKENIZER_MOST
TOKEN_MOST = 48  # characters of a token a report shows; a longer one is cut, its length said
SPLIT_MOST = 256  # characters of a SentencePiece token split into merges (every split: quadratic in its length);
# a longer one (no real vocabulary has one; an attacker's 1 MB token) gets none, and no text is ever made of it
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece's byte fallback: made where no piece holds a byte


class Vocabulary:
    """`strings[id]` the token as the vocabulary holds it (`ĠParis`), None where none is named; encode(text) the
    ids the model's tokenizer makes of `text`, or None without a tokenizer."""

    def __init__(self, strings, tokenizer=None, where=None):
        self.strings, self._tokenizer, self.where, self._ids = strings, tokenizer, where, None
        if tokenizer is not None:  # a query is one text: a tokenizer.json's padding (to 128, say) or truncation is not
            tokenizer.no_padding()  # the model's, but its batching's
            tokenizer.no_truncation()

    def token(self, token_id):
        """The token string of `token_id` as a report shows it (text.field: a control character or newline escaped,
        a long token cut with its length), or None."""
        if self.strings is None or token_id >= len(self.strings) or self.strings[token_id] is None:
            return None
        return field(self.strings[token_id], TOKEN_MOST)

    def shown(self, token_id):
        """What a report shows for `token_id`: its string, or `#id` without one."""
        token = self.token(token_id)
        return f"#{token_id}" if token is None else token

    def encode(self, text):
        """The ids the tokenizer makes of `text` (no special tokens added, no padding or truncation), or None."""
        return None if self._tokenizer is None else self._tokenizer.encode(text, add_special_tokens=False).ids

    def never_made(self):
        """The ids of the tokens the tokenizer's model does not make of their own string (Magikarp's unreachable
        tokens: `ĠParis` split back into its characters gives other merges first), or None without a tokenizer.
        The model alone (BPE merges, a Unigram's best split, WordPiece's longest match), as a pre-tokenised word
        reaches it; added and special tokens (matched before the model) and byte-fallback pieces (`<0xE3>`) are
        left out."""
        if self._tokenizer is None or self.strings is None:
            return None
        added = set(self._tokenizer.get_added_tokens_decoder())
        model = self._tokenizer.model
        never = []
        for token_id, token in enumerate(self.strings):
            if token and token_id not in added and not BYTE_PIECE.fullmatch(token):
                made = model.tokenize(token)
                if len(made) != 1 or made[0].id != token_id:
                    never.append(token_id)
        return never

    def exact(self, string):
        """The id of the token whose string is exactly `string` (the lowest, where two are), or None."""
        if self.strings is None:
            return None
        if self._ids is None:
            self._ids = {}
            for token_id, token in enumerate(self.strings):
                if token is not None:
                    self._ids.setdefault(token, token_id)
        return self._ids.get(string)


def _tokenizers():
    try:
        import tokenizers
        return tokenizers
    except ImportError:
        return None


def _tokenizer_json(folder):
    """The path of tokenizer.json in the model's folder, or at a transformers.js folder's root above its onnx/."""
    for where in sidecar_folders(folder):
        path = os.path.join(where, TOKENIZER)
        if os.path.isfile(path):
            return path
    return None


def _pairs(data):
    """(token, id) of a parsed tokenizer.json: its model's vocab (a map, or Unigram's [token, score] list) and its
    added tokens; entries of another shape skipped."""
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    pairs = vocab.items() if isinstance(vocab, dict) else (
        ((v[0], i) for i, v in enumerate(vocab) if isinstance(v, list) and v) if isinstance(vocab, list) else ())
    added = data.get("added_tokens") if isinstance(data, dict) else None
    pairs = list(pairs) + [(a.get("content"), a.get("id")) for a in (added if isinstance(added, list) else [])
                           if isinstance(a, dict)]
    return [(t, i) for t, i in pairs if isinstance(t, str) and isinstance(i, int) and not isinstance(i, bool)]


def _strings_of(data, vocab_size):
    """[token string or None] * vocab_size from a parsed tokenizer.json: the model's vocab and the added tokens."""
    strings = [None] * vocab_size
    for token, token_id in _pairs(data):
        if 0 <= token_id < vocab_size:
            strings[token_id] = token
    return strings


def vocabulary_size(folder):
    """The vocabulary's size as the files beside a model say it: config.json's vocab_size (or its text_config's),
    else tokenizer.json's ids (its vocab and added tokens, the highest id + 1); None where neither does."""
    for where in sidecar_folders(folder):
        try:
            config = json.loads(sidecars.read(os.path.join(where, "config.json"), "config.json") or b"null")
        except (ValueError, RecursionError):
            config = None
        for section in (config, config.get("text_config")) if isinstance(config, dict) else ():
            size = section.get("vocab_size") if isinstance(section, dict) else None
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                return size
    path = _tokenizer_json(folder)
    raw = sidecars.read(path, TOKENIZER, TOKENIZER_MOST) if path else None
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        return None
    ids = [i for _, i in _pairs(data) if i >= 0]
    return max(ids) + 1 if ids else None


def vocabulary_of(table):
    """The Vocabulary of a table.Table: a GGUF file's own tokens (a byte-level BPE tokenizer rebuilt from them and
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
    library = _tokenizers()
    if library is None:  # the strings alone, from the parsed JSON
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise InspectError(f"{path}: not JSON ({e})") from None
        return Vocabulary(_strings_of(data, table.vocab), None, path)
    try:
        tokenizer = library.Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the library's own parse error, whatever its type
        raise InspectError(f"{path}: tokenizers cannot read it ({str(e).splitlines()[0][:200]})") from None
    # the strings from the library's own parse: Python's of a 33 MB file (Gemma's merges) would leave 300 MiB of
    # freed heap this process never gives back
    strings = [None] * table.vocab
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if 0 <= token_id < table.vocab:
            strings[token_id] = token
    return Vocabulary(strings, tokenizer, path)


def _gguf_tokenizer(table):
    """A tokenizers Tokenizer rebuilt from a GGUF vocabulary as llama.cpp reads its `tokenizer.ggml.model`: `gpt2`
    byte-level BPE from its merges, `llama` SentencePiece (a Unigram of the tokens and their scores, `▁` for a
    space), `bert` WordPiece (`##` continuations, lower-cased where the vocabulary has no capital); None for any
    other model, or without the tokenizers library. InspectError (one line, naming the GGUF keys) where the library
    refuses what the file holds (a merge naming a token the vocabulary lacks, an empty token)."""
    library = _tokenizers()
    if library is None or not table.tokens:
        return None
    build = {"gpt2": _byte_level_bpe, "llama": _sentencepiece, "bert": _wordpiece}.get(table.tokenizer_model)
    if build is None:
        return None
    try:
        return build(library, table)
    except Exception as e:  # noqa: BLE001 - the library's own error, whatever its type
        keys = "tokenizer.ggml.tokens" + (" / tokenizer.ggml.merges" if table.tokenizer_model == "gpt2" else "")
        said = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise InspectError(f"{table.model}: {keys}: the tokenizers library refuses them as a "
                           f"{table.tokenizer_model} vocabulary ({field(said, 160)})") from None


def _byte_level_bpe(library, table):
    if not table.merges:
        return None
    vocab = {token: i for i, token in reversed(list(enumerate(table.tokens)))}
    merges = [tuple(m.split(" ", 1)) for m in table.merges if " " in m]
    tokenizer = library.Tokenizer(library.models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = library.pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def _sentencepiece(library, table):
    """llama.cpp's SentencePiece tokenizer: the text's spaces made `▁`, then, from its characters, the adjacent pair
    whose joined piece has the highest score merged first, again and again (its scores rank merges: Gemma's are
    minus the rank, not a Unigram's log-probabilities, which would split ` Paris` into ▁P, ar, is). A BPE whose
    merges are every split of every piece into two pieces of the vocabulary, by the joined piece's score."""
    tokens = table.tokens
    scores = table.scores if table.scores and len(table.scores) == len(tokens) else [-i for i in range(len(tokens))]
    vocab = {token: i for i, token in reversed(list(enumerate(tokens)))}
    merges = sorted(((scores[i], vocab[token[:k]], vocab[token[k:]], token[:k], token[k:])
                     for token, i in vocab.items() if len(token) <= SPLIT_MOST for k in range(1, len(token))
                     if token[:k] in vocab and token[k:] in vocab), key=lambda m: (-m[0], m[1], m[2]))
    unknown = next((t for t in ("<unk>", "[UNK]") if t in vocab), None)
    tokenizer = library.Tokenizer(library.models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges],
                                                     unk_token=unknown, fuse_unk=True,
                                                     byte_fallback="<0x00>" in vocab))
    tokenizer.normalizer = library.normalizers.Replace(" ", "\u2581")  # SentencePiece's space, kept where it stands
    return tokenizer


def _wordpiece(library, table):
    vocab = {token: i for i, token in reversed(list(enumerate(table.tokens)))}
    unknown = "[UNK]" if "[UNK]" in vocab else table.tokens[0]
    tokenizer = library.Tokenizer(library.models.WordPiece(vocab=vocab, unk_token=unknown))
    cased = any(t.isalpha() and not t.islower() for t in table.tokens[:5000] if not t.startswith("["))
    tokenizer.normalizer = library.normalizers.BertNormalizer(lowercase=not cased)
    tokenizer.pre_tokenizer = library.pre_tokenizers.BertPreTokenizer()
    return tokenizer


def resolve(queries, vocabulary, vocab_size):
    """Each query as one token id: ASCII digits are an id in [0, vocab_size); else the token whose exact string the
    vocabulary holds (`ĠParis`, `▁Paris`, `[CLS]`), or a text the tokenizer makes into exactly one token; where
    those two readings give different ids, the query is ambiguous. UsageError (one line) otherwise."""
    ids = []
    for query in queries:
        if query.isascii() and query.isdigit():  # `²` and `٣` are digits to str.isdigit, and no id
            token_id = int(query)
            if token_id >= vocab_size:
                raise UsageError(f"--query {query}: id out of range [0, {vocab_size})")
            ids.append(token_id)
            continue
        exact, made = vocabulary.exact(query), vocabulary.encode(query)
        if exact is not None and made is not None and made != [exact]:
            raise UsageError(f"--query {query!r} is ambiguous: the vocabulary's token {exact} is that string, and "
                             f"the tokenizer makes {', '.join(vocabulary.shown(i) for i in made) or 'nothing'} "
                             f"({', '.join(map(str, made))}) of it as a text; give the id")
        if exact is not None:
            ids.append(exact)
            continue
        if made is None:
            raise UsageError(f"--query {query!r}: no token of the vocabulary is that string, and a text query needs "
                             f"the model's tokenizer ({TOKENIZER} beside the model, or a GGUF vocabulary, and the "
                             "tokenizers library); give a token id instead")
        if len(made) != 1:
            shown = ", ".join(vocabulary.shown(i) for i in made) or "none"
            raise UsageError(f"--query {query!r}: the tokenizer makes {len(made)} tokens of it ({shown}); "
                             "give a text of one token, a token's exact string, or an id")
        if not 0 <= made[0] < vocab_size:
            raise UsageError(f"--query {query!r}: the tokenizer gives id {made[0]}, outside the table's "
                             f"[0, {vocab_size})")
        ids.append(made[0])
    return list(dict.fromkeys(ids))
