"""Each server's lexical rules, written out (MySQL/MariaDB's sql_lex.cc, SQLite's tokenize.c): where a
string, a quoted name or a comment begins and ends, and what the server would read as a parameter. Used for
`:name` markers (qag/params.py) and by the analysis (which text is a string and which a name)."""

from __future__ import annotations


class LexError(ValueError):
    """The text cannot be read exactly as the server reads it; str() is the reason, for a sentence."""

    def __init__(self, dialect: str, why: str):
        super().__init__(why)
        self.dialect = dialect
        self.why = why


def quoted_end(sql: str, i: int, q: str, backslash: bool) -> int:
    """End (exclusive) of the quoted token opening at i; -1 when it does not end."""
    n = len(sql)
    j = i + 1
    while j < n:
        c = sql[j]
        if backslash and c == "\\":
            j += 2
            continue
        if c == q:
            if j + 1 < n and sql[j + 1] == q:
                j += 2
                continue
            return j + 1
        j += 1
    return -1


# ---- MySQL / MariaDB ------------------------------------------------------------------------------------
_SPACE = frozenset(" \t\n\r\f\v")


def _my_word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "_$") or "\u0080" <= c <= "\uffff"


def mysql_tokens(sql: str, backslash: bool) -> tuple[tuple[str, int, int], ...]:
    """(kind, start, end) tokens by MySQL/MariaDB's lexical rules (sql_lex.cc): kind is str ('...'),
    dq ("..."), ident (`...`), comment, colon, word, op. backslash: whether \\ escapes in strings
    (NO_BACKSLASH_ESCAPES off)."""
    out = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in _SPACE:
            i += 1
        elif c in "'\"`":
            j = quoted_end(sql, i, c, backslash and c != "`")
            if j < 0:
                raise LexError("mysql", f"the quoted text at character {i + 1} does not end")
            out.append(({"'": "str", '"': "dq", "`": "ident"}[c], i, j))
            i = j
        elif c == "#" or (c == "-" and sql.startswith("--", i) and (
                i + 2 >= n or sql[i + 2] in _SPACE or ord(sql[i + 2]) < 32 or ord(sql[i + 2]) == 127)):
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out.append(("comment", i, j))
            i = j
        elif c == "/" and sql.startswith("/*", i):
            if sql[i + 2:i + 3] == "!" or sql[i + 2:i + 4] in ("M!", "m!"):
                raise LexError("mysql", "executable comments (/*! ... */, /*M! ... */) run text the analysis "
                                          "cannot see; write the SQL without them")
            j = sql.find("*/", i + 2)
            if j < 0:
                raise LexError("mysql", f"the comment at character {i + 1} does not end")
            if "/*" in sql[i + 2:j]:
                raise LexError("mysql", "a comment inside a comment")
            out.append(("comment", i, j + 2))
            i = j + 2
        elif c == ":":
            if sql.startswith(":=", i):
                out.append(("op", i, i + 2))
                i += 2
            else:
                out.append(("colon", i, i + 1))
                i += 1
        elif c == "?":
            raise LexError("mysql", "? is a placeholder; name parameters as :name")
        elif _my_word(c):
            j = i + 1
            while j < n and _my_word(sql[j]):
                j += 1
            out.append(("word", i, j))
            i = j
        else:
            out.append(("op", i, i + 1))
            i += 1
    return tuple(out)


def mysql_read(sql: str) -> tuple[tuple[str, int, int], ...]:
    """The tokens, the same whether NO_BACKSLASH_ESCAPES is on or off in the server's sql_mode; LexError when
    the two readings differ or neither reads."""
    try:
        tokens = mysql_tokens(sql, True)
    except LexError:
        tokens = None
    if tokens is None or any(kind in ("str", "dq") and "\\" in sql[a:b] for kind, a, b in tokens):
        try:
            other = mysql_tokens(sql, False)
        except LexError:
            other = None
        if tokens is None and other is None:
            mysql_tokens(sql, True)     # raises the first reading's reason
    else:
        other = tokens
    if other != tokens:
        raise LexError("mysql", "a backslash in a string makes it end elsewhere when the server's sql_mode has "
                                "NO_BACKSLASH_ESCAPES; write the text without a backslash before a quote")
    return tokens


def _sqlite_idchar(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "_$") or ord(c) >= 0x80


def sqlite_tokens(sql: str) -> tuple[tuple[str, int, int], ...]:
    """(kind, start, end) tokens by SQLite's tokenizer (tokenize.c): str, ident ("...", `...`, [...]),
    comment, var (:name, @name, $name, ?NNN), word, op."""
    out = []
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c in _SPACE:
            i += 1
        elif c in "'\"`":
            j = quoted_end(sql, i, c, False)
            if j < 0:
                raise LexError("sqlite", f"the quoted text at character {i + 1} does not end")
            out.append(("str" if c == "'" else "ident", i, j))
            i = j
        elif c == "[":
            j = sql.find("]", i + 1)
            if j < 0:
                raise LexError("sqlite", f"the [name] at character {i + 1} does not end")
            out.append(("ident", i, j + 1))
            i = j + 1
        elif c == "-" and sql.startswith("--", i):
            j = sql.find("\n", i)
            j = n if j < 0 else j
            out.append(("comment", i, j))
            i = j
        elif c == "/" and sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            j = n if j < 0 else j + 2      # SQLite ends an unterminated comment at the end of the text
            out.append(("comment", i, j))
            i = j
        elif c in ":@$#?":
            j = i + 1
            if c == "?":
                while j < n and sql[j].isascii() and sql[j].isdigit():
                    j += 1
            else:
                while j < n and _sqlite_idchar(sql[j]):
                    j += 1
            if c == ":" and j > i + 1:
                out.append(("colon", i, i + 1))
                out.append(("word", i + 1, j))
            elif c != "#" or j > i + 1:
                out.append(("var", i, j))
            else:
                out.append(("op", i, j))
            i = j
        elif _sqlite_idchar(c):
            j = i + 1
            while j < n and _sqlite_idchar(sql[j]):
                j += 1
            out.append(("word", i, j))
            i = j
        else:
            out.append(("op", i, i + 1))
            i += 1
    return tuple(out)
