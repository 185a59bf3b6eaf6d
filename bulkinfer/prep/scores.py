"""Scoring rows (``bulkinfer score``) -> :class:`Request` objects: the texts
of each row and the pairs of them to score, planned for a bi-encoder (each
text embedded on its own, as ``embed`` plans them: :class:`ScorePlanner`) or
a cross-encoder (each pair read at once: :class:`CrossScorePlanner`).

Three row shapes (all may appear in one file):

- pair rows: ``id`` (optional, as for ``bulkinfer run``), ``text_1`` and
  ``text_2``, non-empty strings; every other field passes through. The
  output's ``score`` scores the pair (:func:`bulkinfer.io.records.score_record`).
- rerank rows: ``id``, ``query`` (a non-empty string), ``documents`` (a
  non-empty list of non-empty strings), ``top_n`` (optional, an integer >= 1:
  keep the best N results) and ``return_documents`` (optional boolean: each
  result carries ``document: {"text": ...}``, as vLLM's ``RerankDocument``).
  The output's ``results`` rank the documents (vLLM's and Cohere's
  ``/rerank`` shape).
- OpenAI-style batch lines with the bodies of vLLM's scoring endpoints
  (``vllm.entrypoints.pooling.scoring.protocol``), answered in vLLM's
  response shapes: ``url`` ``/v1/score`` (or ``/score``) with two sides
  named ``queries`` + ``documents`` (or ``items``), ``data_1`` + ``data_2``
  or ``text_1`` + ``text_2``, each a string or a list of strings, one to
  one, one to many or many to many (vLLM's rule); ``url`` ``/v1/rerank``
  (or ``/rerank``) with ``query``, ``documents`` and ``top_n`` (0: all).
  ``model`` and the harmless metadata are accepted; any other body field
  (``use_activation``, ``truncate_prompt_tokens``, ``max_tokens_per_doc``,
  ``instruction``, ...) would change the output and fails the line.

Every problem is an error record naming the row and the field; chat and
completions lines name ``bulkinfer run``, ``/v1/embeddings`` lines
``bulkinfer embed``.

A planned request's ``similarity`` (see :class:`~bulkinfer.schema.Request`)
holds ``shape`` (``pair``, ``rerank`` or ``score``), ``pairs`` (the
``(i, j)`` positions in ``inputs`` of each pair scored, in output order),
``names`` (each input's field, for error messages), ``top_n`` and
``documents`` (rerank only: kept for ``return_documents`` and OpenAI lines).
"""

from __future__ import annotations

from typing import Any

from bulkinfer.config import Settings
from bulkinfer.fields import is_int
from bulkinfer.prep.embeddings import EmbedPlanner, encoder_request
from bulkinfer.prep.envelope import field_error, is_openai_line, openai_line
from bulkinfer.prep.planner import order_for_feed
from bulkinfer.prep.rows import row_id_of
from bulkinfer.prep.unapplied import SCORING, check_unapplied
from bulkinfer.schema import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, Request, RowError, RowInvalid

PAIR_FIELDS = ("text_1", "text_2")
RERANK_FIELDS = ("query", "documents", "top_n", "return_documents")
# The row fields read by score; the rest pass through, but for the request
# parameters it refuses (SCORING).
SCORE_FIELDS = (*PAIR_FIELDS, *RERANK_FIELDS)
SCORE_FIELDS_READ = frozenset({"id", *SCORE_FIELDS, *SCORING})
# A Parquet input needs one of these columns.
SCORE_TEXT_COLUMNS = ("text_1", "query")
SCORE_URLS, RERANK_URLS = ("/v1/score", "/score"), ("/v1/rerank", "/rerank")
# vLLM's ScoreRequest: the two sides, by the names of its four request types.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_SCORE_BODY = frozenset({"model", *(name for sides in SCORE_SIDES for name in sides)})
_BODY_FIELDS = {
    **{url: _SCORE_BODY for url in SCORE_URLS},
    **{url: frozenset({"model", "query", "documents", "top_n"}) for url in RERANK_URLS},
}
_ELSEWHERE = {CHAT_URL: "bulkinfer run", COMPLETIONS_URL: "bulkinfer run", EMBEDDINGS_URL: "bulkinfer embed"}
_SHAPES = "text_1 and text_2 (a pair to score) or query and documents (a query and the documents to rerank)"


def parse_score_row(data: Any, seq: int, line: int) -> Request:
    """Validate one decoded row of a scoring job and build its :class:`Request`
    (``inputs`` and ``similarity`` set; ``seq`` 0-based arrival position,
    ``line`` 1-based line or row).

    Raises:
        RowInvalid: not an object; pair and rerank fields both, or neither
            (the message says which fields are expected, and names
            ``bulkinfer run`` for a prompt/messages row, ``bulkinfer embed``
            for a text/input row); a text missing, not a string or empty;
            ``documents`` not a non-empty list, or an item
            (``documents[K]``) not a non-empty string; ``top_n`` not an
            integer >= 1; ``return_documents`` not a boolean; a request
            parameter score does not apply
            (:data:`~bulkinfer.prep.unapplied.SCORING`); an OpenAI line as
            :func:`_parse_openai` says.
    """
    if not isinstance(data, dict):
        raise RowInvalid("invalid_row", f"expected a JSON object, got {type(data).__name__}")
    if is_openai_line(data, SCORE_FIELDS):
        return _parse_openai(data, seq, line)
    row_id = row_id_of(data, line)
    check_unapplied(data, SCORING, row_id)
    pair = [name for name in PAIR_FIELDS if data.get(name) is not None]
    rerank = [name for name in RERANK_FIELDS if data.get(name) is not None]
    if pair and rerank:
        raise RowInvalid(
            "invalid_row",
            f"row has both pair fields ({', '.join(pair)}) and rerank fields ({', '.join(rerank)}); give {_SHAPES}",
            row_id,
        )
    if not pair and not rerank:
        raise RowInvalid("missing_field", f"row needs {_SHAPES}{_hint(data)}", row_id)
    passthrough = {k: v for k, v in data.items() if k not in ("id", *SCORE_FIELDS)}
    if pair:
        texts = [_text(data, name, row_id) for name in PAIR_FIELDS]
        return _scoring(encoder_request(seq, line, row_id, texts, {}, None, passthrough), "pair", list(PAIR_FIELDS))
    query = _text(data, "query", row_id)
    documents = _documents(data.get("documents"), row_id)
    top_n = data.get("top_n")
    if top_n is not None and not (is_int(top_n) and top_n >= 1):
        raise field_error("top_n", "an integer >= 1", top_n, row_id, False)
    keep = data.get("return_documents")
    if keep is not None and not isinstance(keep, bool):
        raise field_error("return_documents", "true or false", keep, row_id, False)
    request = encoder_request(seq, line, row_id, [query, *documents], {}, None, passthrough)
    names = ["query", *(f"documents[{k}]" for k in range(len(documents)))]
    return _scoring(request, "rerank", names, top_n=top_n, documents=documents if keep else None)


def _scoring(
    request: Request, shape: str, names: list[str], pairs: list[tuple[int, int]] | None = None, **more: Any
) -> Request:
    """``request`` with its ``similarity``: ``pairs`` default to the first
    input with each of the others (a pair row's one pair; a query with each document)."""
    count = len(request.inputs or ())
    pairs = pairs if pairs is not None else [(0, k) for k in range(1, count)]
    request.similarity = {"shape": shape, "pairs": pairs, "names": names, **more}
    return request


def _hint(data: dict[str, Any]) -> str:
    """Where a row of another job's shape belongs."""
    if {"prompt", "messages"} & data.keys():
        return "; prompt/messages rows are generated by `bulkinfer run`"
    if {"text", "input"} & data.keys():
        return "; text/input rows are embedded by `bulkinfer embed`"
    return ""


def _text(data: dict[str, Any], name: str, row_id: str) -> str:
    value = data.get(name)
    if value is None:
        other = "text_2" if name == "text_1" else "text_1"
        needs = f"with '{other}'" if name in PAIR_FIELDS else "with 'documents'"
        raise RowInvalid("missing_field", f"field '{name}' is required {needs}: {_SHAPES}", row_id)
    if not isinstance(value, str) or not value:
        raise field_error(name, "a non-empty string", value, row_id, False)
    return value


def _documents(value: Any, row_id: str) -> list[str]:
    if value is None:
        raise RowInvalid("missing_field", f"field 'documents' is required with 'query': {_SHAPES}", row_id)
    if not isinstance(value, list) or not value:
        raise field_error("documents", "a non-empty list of non-empty strings", value, row_id, False)
    for index, document in enumerate(value):
        if not isinstance(document, str) or not document:
            raise field_error(f"documents[{index}]", "a non-empty string", document, row_id, False)
    return value


def _parse_openai(data: dict[str, Any], seq: int, line: int) -> Request:
    """An OpenAI-style ``/v1/score`` or ``/v1/rerank`` line (vLLM's request bodies).

    Raises:
        RowInvalid: the envelope (:func:`bulkinfer.prep.rows.openai_line`:
            a chat, completions or embeddings line names the command that
            runs it; a body field that would change the output); no side, or
            sides of two request types; a side not a non-empty string or a
            non-empty list of them (multimodal content is not supported);
            side lengths not 1:1, 1:N or N:N; ``top_n`` not an integer >= 0.
    """
    custom_id, url, body = openai_line(data, _BODY_FIELDS, _ELSEWHERE)
    model = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if url in RERANK_URLS:
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise field_error("body.query", "a non-empty string", query, custom_id, True)
        documents, names = _side(body, "documents", custom_id)
        top_n = body.get("top_n", 0)
        if not (is_int(top_n) and top_n >= 0):
            raise field_error("body.top_n", "an integer >= 0 (0: every document)", top_n, custom_id, True)
        request = encoder_request(seq, line, custom_id, [query, *documents], {}, url, model)
        return _scoring(request, "rerank", ["body.query", *names], top_n=top_n or None, documents=documents)
    given = [sides for sides in SCORE_SIDES if sides[0] in body and sides[1] in body]
    if len(given) != 1 or len({name for sides in SCORE_SIDES for name in sides} & body.keys()) != 2:
        named = " + ".join(name for name in body if name in _SCORE_BODY - {"model"}) or "neither"
        raise RowInvalid(
            "invalid_field",
            f"field 'body': {url} needs two sides, one of "
            + ", ".join(" + ".join(sides) for sides in SCORE_SIDES)
            + f" (vLLM's ScoreRequest); got {named}; the row was not run",
            custom_id,
            True,
        )
    first, first_names = _side(body, given[0][0], custom_id)
    second, second_names = _side(body, given[0][1], custom_id)
    if len(first) > 1 and len(first) != len(second):
        raise RowInvalid(
            "invalid_field",
            f"field 'body.{given[0][0]}' has {len(first)} items and 'body.{given[0][1]}' {len(second)}: "
            "the sides must be 1:1, 1:N or N:N, as vLLM's; the row was not run",
            custom_id,
            True,
        )
    request = encoder_request(seq, line, custom_id, [*first, *second], {}, url, model)
    n = len(first)
    pairs = [(0 if n == 1 else k, n + k) for k in range(len(second))]
    return _scoring(request, "score", [*first_names, *second_names], pairs)


def _side(body: dict[str, Any], name: str, custom_id: str) -> tuple[list[str], list[str]]:
    """A side of a scoring body (a string or a non-empty list of them) as a
    list, with each item's field name.

    Raises:
        RowInvalid: as :func:`_parse_openai` says.
    """
    value = body.get(name)
    if isinstance(value, str) and value:
        return [value], [f"body.{name}"]
    if not isinstance(value, list) or not value:
        raise field_error(f"body.{name}", "a non-empty string or a non-empty list of them", value, custom_id, True)
    for index, item in enumerate(value):
        if not isinstance(item, str) or not item:
            why = "a non-empty string (multimodal content is not supported)"
            raise field_error(f"body.{name}[{index}]", why, item, custom_id, True)
    return value, [f"body.{name}[{k}]" for k in range(len(value))]


def to_score_request(data: Any, seq: int, line: int, settings: Settings) -> Request:
    """:func:`parse_score_row` with the row parser signature of
    :func:`bulkinfer.prep.windows.iter_windows` (``settings`` is not read).

    Raises:
        RowInvalid: as parse_score_row.
    """
    return parse_score_row(data, seq, line)


class ScorePlanner(EmbedPlanner):
    """An :class:`~bulkinfer.prep.embeddings.EmbedPlanner` for scoring rows:
    the same tokenizing, ``max_seq_length`` check and ``--truncate`` (every
    text cut on its own: a bi-encoder embeds the two sides of a pair
    separately), its errors naming the row's own fields."""

    OUTPUT_FIELDS = frozenset({"score", "results", "prompt_tokens"})  # bulkinfer.io.records.score_record's

    def input_name(self, request: Request, index: int, count: int) -> str:
        """The row's field of input ``index``: ``text_1``, ``query``, ``documents[K]``, ``body.text_1[K]``, ..."""
        return str((request.similarity or {})["names"][index])


CROSS_ENCODER = "cross-encoder"


class CrossScorePlanner(ScorePlanner):
    """Plans scoring rows for a cross-encoder (a ``*ForSequenceClassification``
    model with one label), which reads both texts of a pair at once.

    Each pair is one input: ``(text_1, text_2)`` of a pair row, ``(query,
    documents[K])`` for each document of a rerank row, encoded as the
    tokenizer's text pair (``[CLS] a [SEP] b [SEP]`` for BERT, segment B's
    token type ids 1), as sentence-transformers' ``CrossEncoder.predict``
    and vLLM's cross-encoder scoring encode it. A pair over
    ``max_seq_length`` tokens (``max_model_len`` here) fails its row
    (``context_length_exceeded``) unless ``truncate``: then it is cut
    longest first (``truncation=True``: the longer text loses tokens first,
    as ``CrossEncoder`` cuts). The planned request's ``pooling`` asks for
    vLLM's ``classify`` task with each pair's ``token_type_starts`` (when
    the tokenizer has token type ids); ``similarity["method"]`` is
    ``"cross-encoder"``: the output's scores are the classifier's outputs.
    """

    def plan_window(self, requests: Any) -> tuple[list[Request], list[RowError]]:
        """Tokenize the pairs of ``requests`` (arrival order); return the
        requests in feed order (by total input tokens) and the rows that failed."""
        errors: list[RowError] = []
        pairs = [pair for request in requests for pair in _pairs(request)]
        encoded = iter(self._encode_pairs(pairs))
        planned: list[Request] = []
        for request in requests:
            if request.openai_url is None:
                self.passthrough.update(request.passthrough.keys())
            own = _pairs(request)
            parts = [next(encoded) for _ in own]
            too_long = [i for i, (ids, _) in enumerate(parts) if len(ids) > self.max_model_len]
            if too_long and not self.truncate:
                errors.append(self._too_long(request, [ids for ids, _ in parts], too_long))
                continue
            if too_long:
                cut = self._encode_pairs([own[i] for i in too_long], truncate=True)
                for i, short in zip(too_long, cut, strict=True):
                    parts[i] = short
                self.truncated_inputs += len(too_long)
            request.input_token_ids, request.inputs = [ids for ids, _ in parts], None
            starts = [start for _, start in parts]
            request.pooling = {"task": "classify", "token_type_starts": None if None in starts else starts}
            request.similarity = {**(request.similarity or {}), "method": CROSS_ENCODER}
            planned.append(request)
        planned.sort(key=lambda r: r.seq)
        self.padding.add_window([r.prompt_length for r in planned])
        return order_for_feed(planned, self.settings.order), errors

    def input_name(self, request: Request, index: int, count: int) -> str:
        """Pair ``index`` by its fields: ``the pair text_1 + text_2``, ``the pair query + documents[K]``, ..."""
        similarity = request.similarity or {}
        first, second = similarity["pairs"][index]
        return f"the pair {similarity['names'][first]} + {similarity['names'][second]}"

    def _encode_pairs(self, pairs: list[tuple[str, str]], truncate: bool = False) -> list[tuple[list[int], int | None]]:
        """Each pair's token ids (special tokens included) and the position of
        its first segment-B token (None when the tokenizer has no token type ids)."""
        if not pairs:
            return []
        typed = "token_type_ids" in self.tokenizer.model_input_names
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not truncate:  # a fast tokenizer's Rust encode_batch: the same ids, no copy
            found = backend.encode_batch(pairs, add_special_tokens=True)
            return [(e.ids, _segment_b_start(e.type_ids) if typed else None) for e in found]
        cut = {"truncation": True, "max_length": self.max_model_len} if truncate else {}
        encoded = self.tokenizer([a for a, _ in pairs], [b for _, b in pairs], **cut)
        types = encoded.get("token_type_ids") if typed else None
        return [
            (list(ids), None if types is None else _segment_b_start(types[k]))
            for k, ids in enumerate(encoded["input_ids"])
        ]


def _pairs(request: Request) -> list[tuple[str, str]]:
    """The text pairs a cross-encoder scores for one row, in output order."""
    texts = request.inputs or []
    return [(texts[i], texts[j]) for i, j in (request.similarity or {})["pairs"]]


def _segment_b_start(token_type_ids: list[int]) -> int:
    """Where segment B starts in a pair's token type ids (zeros, then ones):
    the position of the first 1, or the length when there is none; vLLM's
    ``compress_token_type_ids``, which the engine expands back.

    Raises:
        ValueError: the ids are not zeros followed by ones.
    """
    start = next((i for i, t in enumerate(token_type_ids) if t == 1), len(token_type_ids))
    if any(t != 0 for t in token_type_ids[:start]) or any(t != 1 for t in token_type_ids[start:]):
        raise ValueError(f"token type ids are not zeros followed by ones: {token_type_ids}")
    return start
